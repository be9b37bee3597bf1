"""What ``towers verify`` records in the runs it starts: the parameters before each update through an optimizer.

Every optimizer a strategy's ``prepare`` returns calls ``before_update(self)`` once per real update
(after the accumulation gate, before the parameters change); under ``towers verify --plain`` torch's
global optimizer step pre-hook calls it. Outside ``towers verify`` it is one global check and returns.

Inside (``ProcessInfo.verify_dir`` set), call ``i`` writes the parameters as they stand after ``i``
updates, ``<verify_dir>/rank<r>/step<i>.pt`` (``torch.save`` of full tensors: a sharded parameter is
gathered with ``DTensor.full_tensor()``, which every rank enters, as every rank steps), plus what the
observers noted about the update about to be applied. After ``verify_steps`` updates every rank
raises ``SystemExit(0)`` at the same call, so the script stops cleanly with its collectives paired.
Only the first optimizer that steps is recorded.
"""

from __future__ import annotations

import gc
import json
import os
import warnings
from typing import Any, Callable

import torch

__all__ = ["before_update", "add_observer", "finish", "load_step"]

#: Prefixes that wrappers (DDP, torch.compile, checkpoint wrappers) add to parameter names.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


class _Capture:
    """The recording of one process: which optimizer, how many updates, where the files go."""

    def __init__(self, directory: str, steps: int, rank: int):
        self.directory = os.path.join(directory, f"rank{rank}")
        self.steps = steps
        self.rank = rank
        self.optimizer: Any = None
        self.updates = 0
        self.names: list[str] = []
        self.observers: list[Callable[[], dict[str, Any]]] = []
        os.makedirs(self.directory, exist_ok=True)

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def write(self, *, final: bool = False) -> None:
        tensors = []
        for p in self.params():
            value = p.detach()
            if hasattr(value, "full_tensor"):  # a DTensor shard: every rank takes part in the gather
                value = value.full_tensor()
            tensors.append(value.to("cpu", copy=True).float())
        if not self.names:
            owner = _owner(self.params())
            self.names = _parameter_names(self.params(), owner)
            meta = {"names": self.names, "rank": self.rank, "unsynced_batchnorm": _unsynced_batchnorm(owner)}
            with open(os.path.join(self.directory, "meta.json"), "w", encoding="utf-8") as fh:
                json.dump(meta, fh)
        observed: dict[str, Any] = {}
        if not final:
            for observer in self.observers:
                observed.update(observer())
        path = os.path.join(self.directory, f"step{self.updates}.pt")
        torch.save({"tensors": tensors, "next_update": observed, "final": final}, path + ".tmp")
        os.replace(path + ".tmp", path)

    def before_update(self, optimizer: Any) -> None:
        if self.optimizer is None:
            self.optimizer = optimizer
        elif optimizer is not self.optimizer:
            return  # another optimizer (or the torch optimizer inside a towers wrapper): not recorded
        self.write()
        if self.updates >= self.steps:
            raise SystemExit(0)  # every rank at the same update: the job stops with its collectives paired
        self.updates += 1


_capture: list[_Capture | None] = []  # resolved once per process: [] not yet, [None] off, [capture] on


def _resolve() -> _Capture | None:
    from towers.cluster import from_env

    try:
        info = from_env()
    except ValueError:  # an environment the strategy was built without (explicit info=): not a verify run
        _capture.append(None)
        return None
    capture = _Capture(info.verify_dir, info.verify_steps, info.rank) if info.verify_dir else None
    _capture.append(capture)
    return capture


def before_update(optimizer: Any) -> None:
    """Record the parameters before ``optimizer`` applies an update, when ``towers verify`` runs this process.

    Raises:
        SystemExit: (code 0) after ``verify_steps`` updates under ``towers verify``.
    """
    capture = _capture[0] if _capture else _resolve()
    if capture is not None:
        capture.before_update(optimizer)


def add_observer(observer: Callable[[], dict[str, Any]]) -> None:
    """Add a function whose dict (what the script did since the last update) is saved with each update's record."""
    capture = _capture[0] if _capture else _resolve()
    if capture is not None:
        capture.observers.append(observer)


def finish() -> None:
    """Record the parameters after the last update of a script that ended before ``verify_steps`` updates.

    Only for unsharded parameters (a sharded one would need a collective the finished script cannot join).
    """
    capture = _capture[0] if _capture else None
    if capture is None or capture.optimizer is None:
        return
    if any(hasattr(p, "full_tensor") for p in capture.params()):
        return
    capture.write(final=True)


def load_step(path: str) -> dict[str, Any]:
    """Return one record written by ``before_update`` (``tensors``, ``next_update``, ``final``)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _strip(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _owner(params: list[torch.Tensor]) -> torch.nn.Module | None:
    """The module holding the most of ``params``, the outermost of equals (a wrapper's names lose their prefix)."""
    wanted = {id(p) for p in params}
    best, best_count = None, 0
    with warnings.catch_warnings():  # isinstance on some objects (torch's deprecated aliases) warns
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if _is_module(obj)]
    for obj in objects:
        count = sum(1 for p in obj.parameters() if id(p) in wanted)
        if count > best_count or (count == best_count and best is not None and _depth(obj) > _depth(best)):
            best, best_count = obj, count
    return best


def _is_module(obj: object) -> bool:
    """True for a live ``nn.Module`` (a ``weakref.proxy`` whose object is gone raises on isinstance: not one)."""
    try:
        return isinstance(obj, torch.nn.Module)
    except ReferenceError:
        return False


def _depth(module: torch.nn.Module) -> int:
    return sum(1 for _ in module.modules())


def _parameter_names(params: list[torch.Tensor], owner: torch.nn.Module | None) -> list[str]:
    """Each parameter's name in ``owner`` (wrapper prefixes removed); ``param<i>`` where none is found."""
    by_id = {id(p): _strip(n) for n, p in owner.named_parameters()} if owner is not None else {}
    return [by_id.get(id(p), f"param{i}") for i, p in enumerate(params)]


def _unsynced_batchnorm(owner: torch.nn.Module | None) -> list[str]:
    """The BatchNorm layers of ``owner`` that normalise each replica's share alone (not a SyncBatchNorm)."""
    if owner is None:
        return []
    return [_strip(n) for n, m in owner.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and "Sync" not in type(m).__name__]
