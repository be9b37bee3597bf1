"""The pieces of a job's state as plain values: RNG streams, optimizer state keyed by parameter name, nested paths.

A checkpoint must load under another strategy, so nothing in it may depend on how one
strategy numbers or places things. Optimizer state is therefore keyed by the parameter's name
in the user's module (``"0.weight"``), as ``torch.distributed.checkpoint.state_dict`` keys it,
not by torch's position in ``param_groups``; ``by_name``/``by_index`` convert between the two.
"""

from __future__ import annotations

import random
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from towers._rng import fork_replica_stream
from towers.errors import TowersError

__all__ = ["CheckpointError", "CorruptCheckpointError", "rng_state", "set_rng_state", "optimizer_by_name",
           "optimizer_by_index", "is_by_name", "flatten", "set_path", "flat_key", "is_dtensor", "global_shape"]

#: A place in a nested state: keys of dicts and indices of lists, from the top.
Path = tuple[Any, ...]


class CheckpointError(TowersError, ValueError):
    """A checkpoint is torn, foreign or does not fit; the message names the checkpoint, the key and the fix."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's file is missing, unreadable or changed since it was written; the message names the file."""


# --- RNG streams ----------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Return this process's torch (CPU and CUDA), numpy and ``random`` RNG states as tensors and ints.

    Returns:
        ``{"torch": ..., "cuda": ..., "numpy": ..., "python": ...}``, which ``set_rng_state`` takes and a
        checkpoint saves with ``weights_only=True``.
    """
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
        "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
        "python": {"version": int(py_version), "state": torch.tensor(py_state, dtype=torch.int64), "gauss_next": py_gauss},
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore RNG states captured by ``rng_state``.

    Args:
        state: what ``rng_state`` returned.
    """
    torch.set_rng_state(state["torch"].to("cpu", torch.uint8))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.to("cpu", torch.uint8) for s in state["cuda"]][: torch.cuda.device_count()])
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), int(npy["pos"]),
                         int(npy["has_gauss"]), float(npy["cached_gaussian"])))
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss_next"]))
    if state.get("fork") is not None:  # another replica's saved stream (replica_rng_state): forked for this one
        fork_replica_stream(int(state["fork"]))


# --- optimizer state by parameter name ------------------------------------------------------------
def _ordered_names(optimizer: Any, model: nn.Module) -> list[str]:
    """The name in ``model`` of each parameter of ``optimizer``, in torch's numbering (groups in order)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    ordered = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            ordered.append(names.get(id(p), f"<param group {g} #{i}, not in the model>"))
    return ordered


def is_by_name(state: Mapping[str, Any] | None) -> bool:
    """Return True when an optimizer state's ``param_groups`` name parameters (``by_name``'s form)."""
    groups = (state or {}).get("param_groups") or []
    return any(isinstance(p, str) for g in groups for p in g.get("params", ()))


def optimizer_by_name(state: Mapping[str, Any], optimizer: Any, model: nn.Module) -> dict[str, Any]:
    """Return ``optimizer.state_dict()``-shaped ``state`` with each parameter index replaced by its name in ``model``."""
    names = _ordered_names(optimizer, model)
    return {"state": {names[int(i)]: s for i, s in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}


def optimizer_by_index(state: Mapping[str, Any], optimizer: Any, model: nn.Module) -> dict[str, Any]:
    """Return a ``optimizer_by_name`` state in torch's own numbering for ``optimizer``, ready for its ``load_state_dict``.

    Raises:
        CheckpointError: when the saved parameter names or groups differ from the optimizer's.
    """
    names = _ordered_names(optimizer, model)
    saved = [list(g["params"]) for g in state["param_groups"]]
    own = [names[sum(len(g["params"]) for g in optimizer.param_groups[:k]):][:len(group["params"])]
           for k, group in enumerate(optimizer.param_groups)]
    if saved != own:
        missing = sorted({n for g in own for n in g} - {n for g in saved for n in g})
        unexpected = sorted({n for g in saved for n in g} - {n for g in own for n in g})
        detail = (f"parameters missing from the file {missing[:5]}, unknown to the optimizer {unexpected[:5]}"
                  if missing or unexpected else
                  f"parameter groups of sizes {[len(g) for g in saved]} in the file, {[len(g) for g in own]} here")
        raise CheckpointError(f"the optimizer state does not fit this optimizer: {detail}. Build the same model and "
                              "optimizer (same parameter groups) that wrote it.")
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


# --- nested states as paths -------------------------------------------------------------------------
def is_dtensor(value: Any) -> bool:
    """Return True for a ``torch.distributed.tensor.DTensor`` (a shard of a larger tensor)."""
    return type(value).__name__ == "DTensor" and isinstance(value, torch.Tensor)


def global_shape(value: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor ``value`` is (a part of)."""
    return tuple(value.shape)  # a DTensor's shape is the global one


def flatten(value: Any, prefix: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor inside nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from flatten(item, (*prefix, key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from flatten(item, (*prefix, i))


def set_path(root: Any, path: Path, value: Any) -> Any:
    """Return ``root`` with the element at ``path`` replaced by ``value`` (tuples are rebuilt, dicts and lists set)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(root, tuple):
        items = list(root)
        items[head] = set_path(items[head], rest, value)
        return type(root)(items) if not hasattr(root, "_fields") else type(root)(*items)
    root[head] = set_path(root[head], rest, value)
    return root


def flat_key(path: Path) -> str:
    """The name a tensor at ``path`` has in the checkpoint's tensor files (``model/0.weight``)."""
    parts = []
    for p in path:
        text = str(p).replace("%", "%25").replace("/", "%2F")
        parts.append(f"#{text}" if isinstance(p, int) else text.replace("#", "%23", 1) if text.startswith("#") else text)
    return "/".join(parts)
