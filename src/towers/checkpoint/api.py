"""Save and restore the state of a job, the same way under every strategy and world size.

``save_checkpoint(path, {"model": model, "optimizer": optimizer, "epoch": 3}, strategy=strategy)``
writes a checkpoint directory (``layout.py``): the prepared model's and optimizer's tensors
through ``torch.distributed.checkpoint`` — every process writes its part, nothing is gathered on
one rank — and every other value (modules and objects with ``state_dict()`` as their state dicts,
numbers, strings, tensors) by the chief. ``restore_checkpoint(path, {...}, strategy=strategy)``
reads it under any strategy and any number of processes, resharding where the layout differs,
after checking that every key and shape fits: nothing is ever restored in part.

Optimizer state is keyed by parameter name (``state.py``), so a checkpoint written under
``MirroredStrategy`` restores under ``FullyShardedStrategy``, parameter servers or one process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import torch
from torch import nn

from towers._logging import get_logger
from towers.checkpoint import integrity, layout
from towers.checkpoint.layout import CheckpointIO
from towers.checkpoint.state import (
    CheckpointError,
    flat_key,
    flatten,
    global_shape,
    is_by_name,
    is_dtensor,
    optimizer_by_index,
    optimizer_by_name,
    set_path,
)

__all__ = ["CheckpointStrategy", "save_checkpoint", "write_checkpoint", "load_checkpoint", "restore_checkpoint",
           "checkpoint_info", "checkpoint_exists", "delete_checkpoint", "check_model_fits", "plain_state_dict",
           "load_plain_state_dict", "require_optimizer_state", "read_into"]

log = get_logger(__name__)


class CheckpointStrategy(Protocol):
    """What checkpoints need from a strategy (every ``towers.Strategy`` is one)."""

    @property
    def name(self) -> Any: ...
    @property
    def is_chief(self) -> bool: ...
    @property
    def num_replicas_in_sync(self) -> int: ...
    def state_dict(self, model: nn.Module, optimizer: Any = None) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any], model: nn.Module, optimizer: Any = None) -> None: ...
    def unwrap(self, model: nn.Module) -> nn.Module: ...
    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...
    def all_gather_object(self, obj: Any) -> list[Any]: ...
    def checkpoint_io(self) -> CheckpointIO: ...


# --- one process without a strategy -------------------------------------------------------------------
def plain_state_dict(model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """Return ``{"model", "optimizer"}`` of a module that is not sharded: its state dict, the optimizer's by parameter name."""
    native = optimizer.state_dict() if optimizer is not None else None
    return {"model": model.state_dict(),
            "optimizer": optimizer_by_name(native, optimizer, model) if native is not None else None}


def load_plain_state_dict(state: Mapping[str, Any], model: nn.Module, optimizer: Any = None) -> None:
    """Load a ``plain_state_dict`` (or torch's own optimizer numbering) into ``model`` and ``optimizer``.

    The optimizer loads first: torch checks its state before changing anything.

    Raises:
        CheckpointError: an optimizer was given and ``state`` holds none for it.
    """
    require_optimizer_state(state, optimizer)
    saved = state.get("optimizer")
    if optimizer is not None and saved is not None:
        optimizer.load_state_dict(optimizer_by_index(saved, optimizer, model) if is_by_name(saved) else saved)
    model.load_state_dict(state["model"], strict=True)


def require_optimizer_state(state: Mapping[str, Any], optimizer: Any) -> None:
    """Refuse to load ``state`` into ``optimizer`` when it holds no optimizer state (nothing restored in part silently).

    Raises:
        CheckpointError: ``optimizer`` is given and ``state["optimizer"]`` is missing or None.
    """
    if optimizer is None or state.get("optimizer") is not None:
        return
    raise CheckpointError(
        f"The state to load holds no optimizer state (keys: {sorted(map(str, state))}), but an optimizer "
        f"({type(optimizer).__name__}) was given to fill: loading only the model would restart the optimizer from "
        "zero. Load it with optimizer=None if that is what you want (strategy.load_state_dict(state, model)), or save "
        "the state with its optimizer (strategy.state_dict(model, optimizer)).")


class _OneProcess:
    """The strategy of a script that uses none: one process, it is the chief."""

    name = "none"
    is_chief = True
    num_replicas_in_sync = 1

    def __init__(self) -> None:
        self._io = CheckpointIO(collective=True)

    def state_dict(self, model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
        return plain_state_dict(model, optimizer)

    def load_state_dict(self, state: Mapping[str, Any], model: nn.Module, optimizer: Any = None) -> None:
        load_plain_state_dict(state, model, optimizer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def checkpoint_io(self) -> CheckpointIO:
        return self._io


def _strategy(strategy: CheckpointStrategy | None) -> CheckpointStrategy:
    return strategy if strategy is not None else _OneProcess()


# --- writing -------------------------------------------------------------------------------------------
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


def _prepared_pair(objects: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The keys of the one model (and its optimizer) that go through the strategy, or None."""
    modules = [k for k, v in objects.items() if isinstance(v, nn.Module)]
    optimizers = [k for k, v in objects.items() if isinstance(v, torch.optim.Optimizer)]
    if len(modules) != 1 or len(optimizers) > 1:
        return (None, None) if len(modules) != 1 else (modules[0], None)
    return modules[0], (optimizers[0] if optimizers else None)


def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any], *,
                    strategy: CheckpointStrategy | None = None) -> Path:
    """Write ``state``, your dict, as a checkpoint at ``path``, atomically; return the path. Every process calls it.

    Modules, optimizers and anything with ``state_dict()`` are saved as their states (the one
    prepared model and its optimizer through ``strategy``: each process writes its part, sharded
    or replicated); everything else must load with ``weights_only=True`` (tensors, numbers,
    strings, bools, None, and lists, tuples and dicts of them).

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
    strategy = _strategy(strategy)
    out = dict(state)
    model_key, opt_key = _prepared_pair(state)
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
    strategy = _strategy(strategy)
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
    info = {"strategy": str(strategy.name), "num_replicas": int(strategy.num_replicas_in_sync), "tensors": places,
            "state": skeleton, **dict(manifest or {})}
    layout.write(path, tensors, info, io=strategy.checkpoint_io(), is_chief=strategy.is_chief,
                 broadcast_object=strategy.broadcast_object)
    log.debug("wrote checkpoint %s (%d tensors through DCP)", path, len(tensors))


def _copy_containers(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_containers(v) for v in value]
    if isinstance(value, tuple):
        items = [_copy_containers(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


# --- reading ---------------------------------------------------------------------------------------------
def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return what a checkpoint says of itself: ``strategy`` and ``num_replicas`` that wrote it, its keys.

    Raises:
        FileNotFoundError: when there is no checkpoint at ``path``.
        CheckpointError: when it is not a towers checkpoint.
    """
    manifest = layout.read_manifest(path)
    return {"strategy": manifest.get("strategy"), "num_replicas": manifest.get("num_replicas"),
            "keys": sorted(manifest.get("state", {}))}


def checkpoint_exists(path: str | os.PathLike[str]) -> bool:
    """Return True when a complete checkpoint is published at ``path``."""
    return layout.is_checkpoint(path)


def delete_checkpoint(path: str | os.PathLike[str]) -> None:
    """Remove the checkpoint at ``path`` and everything it holds (nothing if absent); call it on the chief."""
    layout.delete(path)


def load_checkpoint(path: str | os.PathLike[str], *, strategy: CheckpointStrategy | None = None,
                    templates: Mapping[str, torch.Tensor] | None = None,
                    manifest: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Return the dict saved at ``path``, its tensors on the CPU; every process of the job calls it.

    ``templates`` (flat tensor names -> DTensors of this job) receive their tensors resharded in
    place; every other tensor is read whole. ``manifest``: what ``layout.read_manifest(path)`` returned,
    when the caller read it already.

    Every file read is checked against the checksums recorded when it was written.

    Raises:
        FileNotFoundError: when there is no checkpoint at ``path``.
        CorruptCheckpointError: when one of its files is missing, unreadable or changed since it was written
            (the same error on every process), naming the file.
        CheckpointError: when it is not a towers checkpoint, or its files are torn.
    """
    strategy = _strategy(strategy)
    io = strategy.checkpoint_io()
    io.wait(is_chief=strategy.is_chief, broadcast_object=strategy.broadcast_object)
    manifest = layout.read_manifest(path) if manifest is None else manifest
    shapes = layout.tensor_metadata(path)
    if manifest["tensors"] and not shapes:
        raise integrity.damaged(path, ".metadata", "is missing")
    targets: dict[str, torch.Tensor] = {}
    for _, key in manifest["tensors"]:
        if key not in shapes:
            raise CheckpointError(f"Checkpoint {path} is torn: its tensor files lack {key!r}. Restore an older one.")
        given = (templates or {}).get(key)
        shape, dtype = shapes[key]
        targets[key] = given if given is not None and global_shape(given) == shape else torch.empty(shape, dtype=dtype)
    layout.read_tensors(path, targets, io=io)
    state = manifest["state"]
    for tensor_path, key in manifest["tensors"]:
        state = set_path(state, tuple(tensor_path), targets[key])
    return state


def _saved_shapes(manifest: Mapping[str, Any], shapes: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``{state key: global shape or None}`` of the entries saved under ``manifest["state"][key]``."""
    out: dict[str, Any] = {}
    plain = manifest["state"].get(key)
    for name, value in (plain.items() if isinstance(plain, Mapping) else ()):
        out[name] = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    for tensor_path, flat in manifest["tensors"]:
        if tensor_path[0] == key and len(tensor_path) >= 2:
            out[tensor_path[1]] = tuple(shapes[flat][0]) if len(tensor_path) == 2 and flat in shapes else None
    return out


def check_model_fits(path: str | os.PathLike[str], manifest: Mapping[str, Any], shapes: Mapping[str, Any],
                     live: Mapping[str, Any], *, key: str, strategy_name: str, optimizer_key: str | None = None,
                     has_optimizer: bool = False) -> None:
    """Raise ``CheckpointError`` unless the model (and optimizer) saved under ``key`` fit ``live``, before anything loads.

    ``live`` is the strategy's ``state_dict`` of this job's model and optimizer.
    """
    where = (f"The checkpoint was written under strategy {manifest.get('strategy')!r} with "
             f"{manifest.get('num_replicas')} replica(s); this job runs {strategy_name!r}.")
    saved = _saved_shapes(manifest, shapes, key)
    own = {name: (global_shape(v) if isinstance(v, torch.Tensor) else None) for name, v in live["model"].items()}
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    mismatched = [f"{k}: checkpoint {saved[k]} vs model {own[k]}" for k in sorted(set(own) & set(saved))
                  if saved[k] is not None and own[k] is not None and saved[k] != own[k]]
    if missing or unexpected or mismatched:
        parts = [f"missing keys {missing[:5]}" if missing else "", f"unexpected keys {unexpected[:5]}" if unexpected else "",
                 f"shape mismatches {mismatched[:3]}" if mismatched else ""]
        rows = [k for k in unexpected if k.endswith(".rows")] + [k for k in missing if k.endswith(".rows")]
        wrapped = bool(unexpected) and {k.removeprefix("module.") for k in unexpected} == set(missing)
        if rows:
            fix = ("Embedding rows live on parameter-server tasks: restore it under a strategy with ps tasks ('ps' "
                   "or 'hybrid'), or under the one that wrote it.")
        elif wrapped:
            fix = ("The checkpoint holds a wrapped model's keys ('module.' prefix, e.g. DDP): save through the "
                   "strategy (save_checkpoint(..., strategy=strategy)) so the user's own module is saved.")
        else:
            fix = "Build the same model architecture (and sizes) that wrote the checkpoint."
        raise CheckpointError(f"Checkpoint {path} does not fit this model: {'; '.join(p for p in parts if p)}. "
                              f"{where} {fix}")
    if not has_optimizer:
        return
    stored = manifest["state"].get(optimizer_key) if optimizer_key else None
    in_dcp = any(p[0] == optimizer_key for p, _ in manifest["tensors"]) if optimizer_key else False
    if optimizer_key is None or (stored is None and not in_dcp):
        raise CheckpointError(
            f"Checkpoint {path} holds no optimizer state{f' under {optimizer_key!r}' if optimizer_key else ''}, but an "
            f"optimizer was given to restore: restoring only the model would restart the optimizer from zero. {where} "
            "Restore without the optimizer if that is what you want, or save it with the optimizer.")
    saved_groups = (stored or {}).get("param_groups") if isinstance(stored, Mapping) else None
    own_groups = (live.get("optimizer") or {}).get("param_groups")
    if saved_groups is not None and own_groups is not None:
        saved_names = [list(g.get("params", ())) for g in saved_groups]
        own_names = [list(g.get("params", ())) for g in own_groups]
        if saved_names != own_names:
            flat_saved = {n for g in saved_names for n in g}
            flat_own = {n for g in own_names for n in g}
            raise CheckpointError(
                f"Checkpoint {path} does not fit this optimizer: parameter groups of sizes "
                f"{[len(g) for g in saved_names]} in the file, {[len(g) for g in own_names]} here (missing "
                f"{sorted(flat_own - flat_saved)[:5]}, unexpected {sorted(flat_saved - flat_own)[:5]}). {where} "
                "Build the same optimizer (same parameter groups) that wrote it.")


def read_into(path: str | os.PathLike[str], *, strategy: CheckpointStrategy | None, model: nn.Module | None,
              optimizer: Any = None, model_key: str = "model", optimizer_key: str | None = "optimizer",
              check: Mapping[str, nn.Module] | None = None,
              manifest: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return ``(state, manifest)`` of the checkpoint at ``path``, its model/optimizer laid out for ``model``/``optimizer``.

    Checks first, before anything is read: the saved model under ``model_key`` (and optimizer under
    ``optimizer_key`` when ``optimizer`` is given) fit this job's, and each module of ``check``
    fits the state under its key. Shards are read straight into this job's layout. Nothing is
    loaded into the objects: pass ``state`` to ``strategy.load_state_dict``. ``manifest``: the
    checkpoint's manifest when the caller read it already.

    Raises:
        FileNotFoundError, CheckpointError: as ``restore_checkpoint``.
    """
    strategy = _strategy(strategy)
    manifest = dict(layout.read_manifest(path) if manifest is None else manifest)
    templates: dict[str, torch.Tensor] = {}
    if model is not None:
        live = strategy.state_dict(model, optimizer)
        check_model_fits(path, manifest, layout.tensor_metadata(path), live, key=model_key,
                         strategy_name=str(strategy.name), optimizer_key=optimizer_key,
                         has_optimizer=optimizer is not None)
        for key, sub in ((model_key, live["model"]), (optimizer_key, live.get("optimizer"))):
            if key is not None and sub is not None:
                templates.update({flat_key((key, *p)): t for p, t in flatten(sub) if is_dtensor(t)})
    for key, module in (check or {}).items():
        _check_plain_module(path, strategy.unwrap(module), manifest["state"].get(key), key)
    return load_checkpoint(path, strategy=strategy, templates=templates, manifest=manifest), manifest


def restore_checkpoint(path: str | os.PathLike[str], objects: Mapping[str, Any] | None = None, *,
                       strategy: CheckpointStrategy | None = None) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``objects`` and return everything it holds. Every process calls it.

    ``objects`` maps keys of the saved dict to live objects: the prepared model and its optimizer
    (restored through ``strategy``, resharded to this job), other modules, and anything with
    ``load_state_dict`` (schedulers, the distributed dataset's position). Every key and shape is
    checked before anything changes. Keys not in ``objects`` (``"epoch"``, ...) are only returned.

    Raises:
        FileNotFoundError: when there is no checkpoint at ``path``.
        CorruptCheckpointError: when one of its files is missing, unreadable or changed since it was written
            (checked before anything is restored; naming the file).
        CheckpointError: when it is torn or foreign, lacks a key of ``objects``, or a state does not fit
            its object (naming the key, the shapes and the strategies involved).
    """
    strategy = _strategy(strategy)
    objects = dict(objects or {})
    manifest = layout.read_manifest(path)
    held = set(manifest["state"])
    missing = [k for k in objects if k not in held]
    if missing:
        raise CheckpointError(f"Checkpoint {path} has no {missing}; it holds {sorted(held)}. Pass the keys you saved.")
    model_key, opt_key = _prepared_pair(objects)
    others = {k: v for k, v in objects.items() if k != model_key and isinstance(v, nn.Module)}
    state, manifest = read_into(path, strategy=strategy, model=objects[model_key] if model_key else None,
                                optimizer=objects[opt_key] if opt_key else None, model_key=model_key or "model",
                                optimizer_key=opt_key, check=others, manifest=manifest)
    if model_key is not None:
        try:
            strategy.load_state_dict({"model": state[model_key], "optimizer": state[opt_key] if opt_key else None,
                                      "precision": manifest.get("precision") or {}},
                                     objects[model_key], objects[opt_key] if opt_key else None)
        except (RuntimeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"Checkpoint {path} does not fit this model/optimizer: {exc}") from None
    for key, obj in objects.items():
        if key in (model_key, opt_key):
            continue
        if isinstance(obj, nn.Module):
            strategy.unwrap(obj).load_state_dict(state[key], strict=True)
        elif callable(getattr(obj, "load_state_dict", None)):
            obj.load_state_dict(state[key])
        else:
            raise CheckpointError(f"Cannot restore {key!r} in place: {type(obj).__name__} has no load_state_dict. "
                                  f"Read plain values from the returned dict instead: restore_checkpoint(...)[{key!r}].")
    return state


def _check_plain_module(path: Any, module: nn.Module, saved: Any, key: str) -> None:
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"Checkpoint {path}: {key!r} holds no module state_dict (found {type(saved).__name__}).")
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    shapes = [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(own[k].shape)}" for k in sorted(set(own) & set(saved))
              if isinstance(saved[k], torch.Tensor) and tuple(saved[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        raise CheckpointError(f"Checkpoint {path}: {key!r} does not fit this module (missing keys {missing[:5]}, "
                              f"unexpected keys {unexpected[:5]}, shape mismatches {shapes[:3]}). Build the same "
                              "module that wrote it.")
