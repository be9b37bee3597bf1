"""Reading a checkpoint back under any strategy and world size: ``load_checkpoint``, ``restore_checkpoint``.

Every key and shape is checked before anything is read into an object (``fit.py``): nothing is
ever restored in part.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch
from torch import nn

from towers.checkpoint import integrity, layout
from towers.checkpoint.fit import check_model_fits, check_plain_module
from towers.checkpoint.protocol import CheckpointStrategy, or_one_process
from towers.checkpoint.save import prepared_pair
from towers.checkpoint.state import CheckpointError, flat_key, flatten, global_shape, is_dtensor, set_path

__all__ = ["checkpoint_info", "checkpoint_exists", "delete_checkpoint", "load_checkpoint", "read_into",
           "restore_checkpoint"]


def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return what a checkpoint says of itself: ``strategy`` and ``num_replicas`` that wrote it, its keys.

    Args:
        path: the checkpoint's folder.

    Returns:
        Its manifest's description: the ``strategy`` and ``num_replicas`` that wrote it, and its keys.

    Raises:
        FileNotFoundError: when there is no checkpoint at ``path``.
        CheckpointError: when it is not a towers checkpoint.
    """
    manifest = layout.read_manifest(path)
    return {"strategy": manifest.get("strategy"), "num_replicas": manifest.get("num_replicas"),
            "keys": sorted(manifest.get("state", {}))}


def checkpoint_exists(path: str | os.PathLike[str]) -> bool:
    """Return True when a complete checkpoint is published at ``path``.

    Args:
        path: the checkpoint's folder.

    Returns:
        False when nothing, or a checkpoint still being written, is there.
    """
    return layout.is_checkpoint(path)


def delete_checkpoint(path: str | os.PathLike[str]) -> None:
    """Remove the checkpoint at ``path`` and everything it holds (nothing if absent); call it on the chief.

    Args:
        path: the checkpoint's folder.
    """
    layout.delete(path)


def load_checkpoint(path: str | os.PathLike[str], *, strategy: CheckpointStrategy | None = None,
                    templates: Mapping[str, torch.Tensor] | None = None,
                    manifest: Mapping[str, Any] | None = None,
                    held: Callable[[tuple[Any, ...]], bool] | None = None) -> dict[str, Any]:
    """Return the dict saved at ``path``, its tensors on the CPU; every process of the job calls it.

    Every file read is checked against the checksums recorded when it was written.

    Args:
        path: the checkpoint's folder.
        strategy: the job's strategy (its processes read together). None: this process alone.
        templates: flat tensor names -> DTensors of this job; they receive their tensors resharded in place.
            Every other tensor is read whole.
        manifest: what ``layout.read_manifest(path)`` returned, when the caller read it already.
        held: whether this process holds the tensor at a path (False: not read, None in the result: another
            pipeline stage's); None: every tensor is read.

    Returns:
        The dict as saved, modules and optimizers as their state dicts.

    Raises:
        FileNotFoundError: when there is no checkpoint at ``path``.
        CorruptCheckpointError: when one of its files is missing, unreadable or changed since it was written
            (the same error on every process), naming the file.
        CheckpointError: when it is not a towers checkpoint, or its files are torn.
    """
    strategy = or_one_process(strategy)
    io = strategy.checkpoint_io()
    io.wait(is_chief=strategy.is_chief, broadcast_object=strategy.broadcast_object)
    manifest = layout.read_manifest(path) if manifest is None else manifest
    shapes = layout.tensor_metadata(path)
    if manifest["tensors"] and not shapes:
        raise integrity.damaged(path, ".metadata", "is missing")
    targets: dict[str, torch.Tensor] = {}
    for tensor_path, key in manifest["tensors"]:
        if held is not None and not held(tuple(tensor_path)):
            continue
        if key not in shapes:
            raise CheckpointError(f"Checkpoint {path} is torn: its tensor files lack {key!r}. Restore an older one.")
        given = (templates or {}).get(key)
        shape, dtype = shapes[key]
        targets[key] = given if given is not None and global_shape(given) == shape else torch.empty(shape, dtype=dtype)
    layout.read_tensors(path, targets, io=io)
    state = manifest["state"]
    for tensor_path, key in manifest["tensors"]:
        if key in targets:
            state = set_path(state, tuple(tensor_path), targets[key])
    return state


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
    strategy = or_one_process(strategy)
    manifest = dict(layout.read_manifest(path) if manifest is None else manifest)
    templates: dict[str, torch.Tensor] = {}
    held: Callable[[tuple[Any, ...]], bool] | None = None
    if model is not None:
        live = strategy.state_dict(model, optimizer)
        gather_parts = strategy.checkpoint_io().gather_parts
        check_model_fits(path, manifest, layout.tensor_metadata(path),
                         live if gather_parts is None else _whole(live, gather_parts), key=model_key,
                         strategy_name=str(strategy.name), optimizer_key=optimizer_key,
                         has_optimizer=optimizer is not None)
        for key, sub in ((model_key, live["model"]), (optimizer_key, live.get("optimizer"))):
            if key is not None and sub is not None:
                templates.update({flat_key((key, *p)): t for p, t in flatten(sub) if is_dtensor(t)})
        if gather_parts is not None:  # a pipeline stage reads its own parameters' tensors only
            held = _holds(set(live["model"]), model_key, optimizer_key)
    for key, module in (check or {}).items():
        check_plain_module(path, strategy.unwrap(module), manifest["state"].get(key), key)
    return load_checkpoint(path, strategy=strategy, templates=templates, manifest=manifest, held=held), manifest


def _whole(live: Mapping[str, Any], gather_parts: Callable[[Any], list[Any]]) -> dict[str, Any]:
    """``live`` with its model's entries those of every part (pipeline stage): shapes only, on the meta device."""
    own = {k: global_shape(v) if isinstance(v, torch.Tensor) else None for k, v in live["model"].items()}
    model = {k: None if shape is None else torch.empty(shape, device="meta")
             for part in gather_parts(own) for k, shape in part.items()}
    return {**live, "model": model}


def _holds(names: set[str], model_key: str, optimizer_key: str | None) -> Callable[[tuple[Any, ...]], bool]:
    """Whether a tensor path of the checkpoint is this part's: its model entries and their optimizer state."""
    def held(tensor_path: tuple[Any, ...]) -> bool:
        if tensor_path[0] == model_key and len(tensor_path) > 1:
            return tensor_path[1] in names
        if tensor_path[0] == optimizer_key and len(tensor_path) > 2 and tensor_path[1] == "state":
            return tensor_path[2] in names
        return True

    return held


def restore_checkpoint(path: str | os.PathLike[str], objects: Mapping[str, Any] | None = None, *,
                       strategy: CheckpointStrategy | None = None) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``objects`` and return everything it holds. Every process calls it.

    Args:
        path: the checkpoint's folder.
        objects: keys of the saved dict -> live objects: the prepared model and its optimizer (restored
            through ``strategy``, resharded to this job), other modules, and anything with ``load_state_dict``
            (schedulers, the distributed dataset's position). Every key and shape is checked before anything
            changes. Keys not in ``objects`` (``"epoch"``, ...) are only returned.
        strategy: the job's strategy. None: one process, the objects as they are.

    Returns:
        Everything the checkpoint holds, the restored objects' states included.

    Raises:
        FileNotFoundError: when there is no checkpoint at ``path``.
        CorruptCheckpointError: when one of its files is missing, unreadable or changed since it was written
            (checked before anything is restored; naming the file).
        CheckpointError: when it is torn or foreign, lacks a key of ``objects``, or a state does not fit
            its object (naming the key, the shapes and the strategies involved).

    Example:
        ```python
        import torch
        from towers.checkpoint import restore_checkpoint, save_checkpoint

        model = torch.nn.Linear(4, 2)
        save_checkpoint("ckpt/one", {"model": model, "epoch": 7})
        fresh = torch.nn.Linear(4, 2)
        state = restore_checkpoint("ckpt/one", {"model": fresh})
        assert state["epoch"] == 7 and torch.equal(fresh.weight, model.weight)
        ```
    """
    strategy = or_one_process(strategy)
    objects = dict(objects or {})
    manifest = layout.read_manifest(path)
    held = set(manifest["state"])
    missing = [k for k in objects if k not in held]
    if missing:
        raise CheckpointError(f"Checkpoint {path} has no {missing}; it holds {sorted(held)}. Pass the keys you saved.")
    model_key, opt_key = prepared_pair(objects)
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
