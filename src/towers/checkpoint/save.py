"""``save_checkpoint``: your dict written as a checkpoint through a strategy, every process its part."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from towers._logging import get_logger
from towers.checkpoint import layout
from towers.checkpoint.protocol import CheckpointStrategy, or_one_process
from towers.checkpoint.state import CheckpointError, flat_key, flatten, is_dtensor, set_path

__all__ = ["save_checkpoint", "write_checkpoint", "prepared_pair"]

log = get_logger(__name__)

_LEAVES = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and not isinstance(value, (Mapping, torch.Tensor))


def _check_loadable(value: Any, where: str, path: Path) -> None:
    """Raise ``CheckpointError`` naming ``where`` unless ``value`` loads with ``torch.load(weights_only=True)``."""
    if isinstance(value, _LEAVES):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise CheckpointError(f"Cannot write checkpoint {path}: {where} has a key {key!r} of type "
                                      f"{type(key).__name__}; use str or int keys.")
            _check_loadable(item, f"{where}[{key!r}]", path)
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_loadable(item, f"{where}[{i}]", path)
        return
    hint = (" Convert it with torch.from_numpy(value)." if type(value).__module__.startswith("numpy") else
            " Store its fields (numbers, strings, tensors) instead, or give it state_dict()/load_state_dict().")
    raise CheckpointError(
        f"Cannot write checkpoint {path}: {where} is a {type(value).__name__}, which torch.load(weights_only=True) "
        f"refuses (checkpoints never unpickle arbitrary objects). Allowed: tensors, numbers, strings, bools, None, "
        f"and lists, tuples and dicts of them, or objects with state_dict().{hint}")


def prepared_pair(objects: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """Return the keys of the one model (and its optimizer) that go through the strategy, or None."""
    modules = [k for k, v in objects.items() if isinstance(v, nn.Module)]
    optimizers = [k for k, v in objects.items() if isinstance(v, torch.optim.Optimizer)]
    if len(modules) != 1 or len(optimizers) > 1:
        return (None, None) if len(modules) != 1 else (modules[0], None)
    return modules[0], (optimizers[0] if optimizers else None)


def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any], *,
                    strategy: CheckpointStrategy | None = None) -> Path:
    """Write ``state``, your dict, as a checkpoint at ``path``, atomically; return the path. Every process calls it.

    Args:
        path: the checkpoint's folder (replaced atomically when it holds an earlier towers checkpoint).
        state: your dict with str keys. Modules, optimizers and anything with ``state_dict()`` are saved as
            their states (the one prepared model and its optimizer through ``strategy``: each process writes its
            part, sharded or replicated); everything else must load with ``weights_only=True`` (tensors,
            numbers, strings, bools, None, and lists, tuples and dicts of them).
        strategy: the job's strategy. None: one process writes everything.

    Returns:
        ``path``, as a ``Path``.

    Raises:
        CheckpointError: when ``state`` is not a dict of str keys, or holds a value that would not load
            with ``weights_only=True`` (naming the key), or something towers did not write is at ``path``.
        OSError: on every process, when the checkpoint cannot be written (the previous one stays loadable).
    """
    path = Path(path)
    if not isinstance(state, Mapping):
        raise CheckpointError(f"Cannot write checkpoint {path}: state must be a dict. Received: "
                              f"{type(state).__name__}. Example: save_checkpoint(path, {{'model': model, 'epoch': 3}}).")
    bad = [k for k in state if not isinstance(k, str)]
    if bad:
        raise CheckpointError(f"Cannot write checkpoint {path}: keys must be strings. Received: {bad}. Rename them.")
    strategy = or_one_process(strategy)
    out = dict(state)
    model_key, opt_key = prepared_pair(state)
    distributed: list[str] = []
    precision: Any = None
    if model_key is not None:
        full = strategy.state_dict(state[model_key], state[opt_key] if opt_key else None)
        out[model_key] = full["model"]
        distributed.append(model_key)
        if opt_key is not None:
            out[opt_key] = full["optimizer"]
            distributed.append(opt_key)
        precision = full.get("precision")
    for key in ("model", "optimizer"):  # a strategy's state dicts passed as they are: each process writes its part
        if key not in distributed and isinstance(state.get(key), Mapping):
            distributed.append(key)
    for key, value in state.items():
        if key in distributed:
            continue
        if isinstance(value, nn.Module):
            out[key] = strategy.unwrap(value).state_dict()
        elif isinstance(value, torch.optim.Optimizer):
            raise CheckpointError(f"Cannot write checkpoint {path}: {key!r} is an optimizer but the state holds no "
                                  "single model for it (found several modules or optimizers). Save one model and its "
                                  "optimizer per checkpoint, or pass their state dicts.")
        elif _is_stateful(value):
            out[key] = value.state_dict()
        _check_loadable(out[key], repr(key) if out[key] is value else f"{key!r}.state_dict()", path)
    write_checkpoint(path, out, strategy=strategy, distributed_keys=distributed,
                     manifest={"precision": precision} if precision else None)
    return path


def write_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any], *, strategy: CheckpointStrategy | None,
                     distributed_keys: Sequence[str] = ("model", "optimizer"),
                     manifest: Mapping[str, Any] | None = None) -> None:
    """Write ``state`` (state dicts and plain values already) at ``path``; every process calls it.

    The tensors under ``distributed_keys`` (the strategy's model and optimizer state) and every
    DTensor go through DCP, written by every process of a collective strategy (each its part) or
    by the chief; the rest is the chief's. ``manifest`` entries are stored beside the manifest.

    Raises:
        CheckpointError, OSError: as ``save_checkpoint``.
    """
    strategy = or_one_process(strategy)
    tensors: dict[str, torch.Tensor] = {}
    places: list[list[Any]] = []
    for tensor_path, tensor in flatten(state):
        if tensor_path[0] in distributed_keys or is_dtensor(tensor):
            key = flat_key(tensor_path)
            tensors[key] = tensor
            places.append([list(tensor_path), key])
    # the plain values, with every tensor written through DCP replaced by None
    skeleton = _copy_containers(state)
    for tensor_path, _ in places:
        skeleton = set_path(skeleton, tuple(tensor_path), None)
    gather_parts = strategy.checkpoint_io().gather_parts
    if gather_parts is not None:  # the processes hold different parts (pipeline stages): the manifest lists them all
        places, skeleton = _merge_parts(gather_parts((places, skeleton)))
    info = {"strategy": str(strategy.name), "num_replicas": int(strategy.num_replicas_in_sync), "tensors": places,
            "state": skeleton, **dict(manifest or {})}
    layout.write(path, tensors, info, io=strategy.checkpoint_io(), is_chief=strategy.is_chief,
                 broadcast_object=strategy.broadcast_object)
    log.debug("wrote checkpoint %s (%d tensors through DCP)", path, len(tensors))


def _merge_parts(parts: Sequence[tuple[list[list[Any]], Any]]) -> tuple[list[list[Any]], Any]:
    """Every part's tensor places (each once) and their skeletons merged: dicts key by key, any other value the
    first part's (the chief's)."""
    places: list[list[Any]] = []
    seen: set[str] = set()
    for part_places, _ in parts:
        for place in part_places:
            if place[1] not in seen:
                seen.add(place[1])
                places.append(place)
    skeleton = parts[0][1]
    for _, other in parts[1:]:
        skeleton = _merge(skeleton, other)
    return places, skeleton


def _merge(first: Any, other: Any) -> Any:
    if not (isinstance(first, Mapping) and isinstance(other, Mapping)):
        return first
    return {**{k: _merge(v, other[k]) if k in other else v for k, v in first.items()},
            **{k: v for k, v in other.items() if k not in first}}


def _copy_containers(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_containers(v) for v in value]
    if isinstance(value, tuple):
        items = [_copy_containers(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value
