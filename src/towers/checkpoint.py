"""Atomic checkpoints: written once by the chief, read by every replica with ``weights_only=True``.

File format (a ``torch.save`` of plain dicts, lists, ints, floats, strings and tensors only):

=================  ========================================================================
key                value
=================  ========================================================================
``format``         ``"towers.checkpoint"`` — the marker that tells our files from others
``version``        ``1`` (``FORMAT_VERSION``); a newer file is refused with a clear error
``kind``           ``"full"`` (training state) or ``"weights"`` (model only)
``strategy``       name of the strategy that wrote it (e.g. ``"mirrored"``)
``num_replicas``   ``num_replicas_in_sync`` of the job that wrote it
``model``          the unwrapped module's ``state_dict()``
``optimizer``      the prepared optimizer's ``state_dict()`` or ``None``
``precision``      the strategy's precision state, e.g. the fp16 loss scale
``epoch``          the epoch in progress (0-based); ``step`` training steps of it are done
``global_step``    steps done since the first epoch
``data``           ``{"epoch", "examples", "global_batch_size", "seed", "state"}``: how many examples of
                   the epoch's (deterministic, seeded) order were consumed, and the distributed
                   dataset's own ``state_dict()`` when it has one
``rng``            one entry per replica: ``{"torch", "cuda", "numpy", "python"}`` with tensors
``metrics``        ``{name: {"totals": tensor}}``: the epoch's running sums, already reduced
``history``        ``History.state_dict()`` of the epochs already finished
``callbacks``      ``{key: state}`` of callbacks that implement ``state_dict``
=================  ========================================================================

A **user checkpoint** (``kind="user"``, what a custom loop saves) is any dict of your own:
``save_checkpoint(path, {"model": model, "optimizer": optimizer, "epoch": 3})``. Objects with a
``state_dict()`` (modules, optimizers, schedulers, scalers) are saved as their state dicts, a
prepared model through its strategy; every other value must load with ``weights_only=True``
(tensors, numbers, strings, bools, None, and lists, tuples and dicts of them).
``restore_checkpoint(path, {"model": model, "optimizer": optimizer})`` loads them back and
returns the whole dict (so ``["epoch"]`` too). ``CheckpointManager`` keeps the last N of them.

Writing is atomic: the chief writes a temporary file in the checkpoint's directory, flushes and
fsyncs it, ``os.replace``-s it over the target and fsyncs the directory. A process killed at any
instant leaves either the previous checkpoint or the new one, never a torn file under the name.

Restoring under a different replica count: the model, optimizer and scaler are restored as they
are (they do not depend on the replica count). The data position is kept in *examples* of the
epoch's global order; the run resumes at ``examples // global_batch_size`` global batches, which
is the exact step when the global batch size is unchanged (the usual case: it is a global
quantity). With a different global batch size it resumes at the last global-batch boundary not
past the saved position (a few examples may be seen twice; a warning says so). Each replica
restores its own RNG state when the replica count matches; otherwise replica ``r`` takes the
state of saved replica ``r % saved_count``, so random ops after a resize differ from an
uninterrupted run while the maths of the updates does not.
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import torch
from torch import nn

from towers._logging import get_logger
from towers.process_group import first_line

if TYPE_CHECKING:
    from towers.strategies.base import Strategy

__all__ = [
    "remove_stale_temp_files",
    "FORMAT", "FORMAT_VERSION", "CheckpointError", "save_checkpoint", "load_checkpoint", "restore_checkpoint",
    "CheckpointManager", "rng_state", "set_rng_state", "check_model_state", "check_optimizer_state",
    "load_model_state",
]

log = get_logger(__name__)

FORMAT = "towers.checkpoint"
FORMAT_VERSION = 1
_REQUIRED = {"full": ("model", "optimizer", "epoch", "step", "global_step", "data", "rng"), "weights": ("model",),
             "user": ()}
#: Keys the file format itself uses; a user dict cannot hold them.
_RESERVED = ("format", "version", "kind")


class CheckpointError(ValueError):
    """A checkpoint file is torn, foreign or incompatible; the message names the file and the problem."""


# --- RNG states as tensors ------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Return this process's torch (CPU and CUDA), numpy and ``random`` RNG states as tensors and ints."""
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
    """Restore RNG states captured by ``rng_state``."""
    torch.set_rng_state(state["torch"].to("cpu", torch.uint8))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.to("cpu", torch.uint8) for s in state["cuda"]][: torch.cuda.device_count()])
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), int(npy["pos"]),
                         int(npy["has_gauss"]), float(npy["cached_gaussian"])))
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss_next"]))


# --- writing --------------------------------------------------------------------------------------
def _serialize(state: Mapping[str, Any], f: Any) -> None:
    # One seam for tests that need a writer to stop half-way.
    torch.save(dict(state), f)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems (and Windows) cannot open a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_atomic(path: Path, state: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            _serialize(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a writer that was killed
        with contextlib.suppress(OSError):
            stale.unlink()


def remove_stale_temp_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files (``.<name>.<pid>.tmp``) that killed writers left in ``directory``; return them.

    A file whose writer (the pid in its name) still runs on this host is kept: it is being written.
    """
    removed = []
    for tmp in Path(directory).glob(".*.*.tmp"):
        pid_text = tmp.name.rsplit(".", 2)[-2]
        if not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue
        with contextlib.suppress(OSError):
            tmp.unlink()
            removed.append(tmp)
    if removed:
        log.info("removed %d checkpoint temporary file(s) left by killed writers in %s", len(removed), directory)
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


# --- user dicts -----------------------------------------------------------------------------------
_LEAVES = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and not isinstance(value, Mapping)


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


def _user_state(state: Mapping[str, Any], path: Path, strategy: "Strategy | None") -> dict[str, Any]:
    """Return ``state`` with every object that has ``state_dict()`` replaced by its state dict, checked loadable."""
    bad = [k for k in state if not isinstance(k, str) or k in _RESERVED]
    if bad:
        raise CheckpointError(f"Cannot write checkpoint {path}: keys must be strings other than {list(_RESERVED)} "
                              f"(the file format uses those). Received: {bad}. Rename them.")
    out = dict(state)
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    optimizers = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
    if strategy is not None and len(modules) == 1 and len(optimizers) <= 1:
        # One model (and its optimizer): the strategy gathers them, full or from wherever they live.
        opt_key = optimizers[0] if optimizers else None
        full = strategy.state_dict(state[modules[0]], state[opt_key] if opt_key else None)
        out[modules[0]] = full["model"]
        if opt_key is not None:
            out[opt_key] = full["optimizer"]
    for key, value in state.items():
        if out[key] is not value:
            continue  # done by the strategy above
        if isinstance(value, nn.Module):
            out[key] = (strategy.unwrap(value) if strategy is not None else value).state_dict()
        elif _is_stateful(value):
            out[key] = value.state_dict()
        _check_loadable(out[key], repr(key) if out[key] is value else f"{key!r}.state_dict()", path)
    return out


def _is_full_training_state(state: Mapping[str, Any]) -> bool:
    return all(k in state for k in _REQUIRED["full"]) and not any(_is_stateful(v) for v in state.values())


def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any], *,
                    strategy: "Strategy | None" = None, kind: str | None = None) -> Path:
    """Write ``state`` (plus the format marker) to ``path`` atomically, on the chief only; return the path.

    ``state`` is your own dict (``kind="user"``): ``{"model": model, "optimizer": optimizer,
    "epoch": 3}`` — objects with ``state_dict()`` are saved as their state dicts (a prepared model
    through ``strategy``), everything else must load with ``weights_only=True``. ``kind="full"``
    (the Trainer's training state) and ``"weights"`` check the keys the Trainer needs; ``None``
    picks ``"full"`` for such a state and ``"user"`` otherwise.

    Every replica must call this (it ends with a collective that tells every replica whether the
    chief's write succeeded, so they all return or all raise).

    Raises:
        CheckpointError: when ``state`` lacks a key its kind needs, or holds a value that would not
            load with ``weights_only=True`` (the message names the key and the fix).
        OSError: on every replica, when the chief could not write the file.
    """
    path = Path(path)
    if not isinstance(state, Mapping):
        raise CheckpointError(f"Cannot write checkpoint {path}: state must be a dict. Received: "
                              f"{type(state).__name__}. Example: save_checkpoint(path, {{'model': model, 'epoch': 3}}).")
    if kind is None:
        kind = "full" if _is_full_training_state(state) else "user"
    if kind not in _REQUIRED:
        raise ValueError(f"kind must be 'user', 'full' or 'weights' (or None to choose). Received: {kind!r}.")
    missing = [k for k in _REQUIRED[kind] if k not in state]
    if missing:
        raise CheckpointError(
            f"Cannot write checkpoint {path}: the state lacks {missing} needed by a {kind!r} checkpoint (the "
            "Trainer's training state). To save your own dict, pass kind='user' (or leave kind=None); "
            "trainer.save_checkpoint(path) writes a full one.")
    if kind == "user":
        state = _user_state(state, path, strategy)
    error = None
    if strategy is None or strategy.is_chief:
        try:
            _write_atomic(path, {**state, "format": FORMAT, "version": FORMAT_VERSION, "kind": kind})
            log.debug("wrote checkpoint %s", path)
        except Exception as exc:  # reported to every replica below, so none waits for the chief
            error = f"{type(exc).__name__}: {exc}"
    if strategy is not None:
        error = strategy.broadcast_object(error, src=0)
    if error is not None:
        raise OSError(f"The chief could not write checkpoint {path}: {error}. Check the directory and free space.")
    return path


# --- reading --------------------------------------------------------------------------------------
def load_checkpoint(path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu",
                    kind: str | None = None) -> dict[str, Any]:
    """Return the checkpoint at ``path`` (loaded with ``weights_only=True``) after checking its format.

    Raises:
        FileNotFoundError: when there is no file at ``path``.
        CheckpointError: when the file is torn, not a towers checkpoint, newer than this version,
            or lacks keys its kind needs.
    """
    path = Path(path)
    if path.parent.is_dir():
        remove_stale_temp_files(path.parent)  # start-up: what a writer killed mid-save left behind
    if not path.is_file():
        raise FileNotFoundError(f"No checkpoint at {path}. Check the path (or that the chief has written it).")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torn zip, random bytes, pickled classes: all "not readable"
        raise CheckpointError(
            f"Checkpoint {path} cannot be read ({type(exc).__name__}: {first_line(exc)}). The file is torn, corrupt "
            "or not a torch.save file; delete it to start over or restore an older checkpoint.") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = sorted(map(str, state))[:8] if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{path} is not a towers checkpoint (no format={FORMAT!r} marker; found {found}). "
            "A plain state_dict loads with model.load_state_dict(torch.load(path)).")
    version = state.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise CheckpointError(
            f"Checkpoint {path} has format version {version!r}; this towers reads versions 1..{FORMAT_VERSION}. "
            "Upgrade towers to read it.")
    file_kind = state.get("kind", "full")
    if kind == "full" and file_kind == "user":
        raise CheckpointError(f"Checkpoint {path} is a user checkpoint (your own dict, kind='user'), not the Trainer's "
                              "training state. Load it with towers.checkpoint.restore_checkpoint(path, {...}).")
    if kind == "full" and file_kind != "full":
        raise CheckpointError(f"Checkpoint {path} holds only model weights (kind={file_kind!r}); "
                              "resuming training needs a full checkpoint (BackupAndRestore or save_weights_only=False).")
    if file_kind not in _REQUIRED:
        raise CheckpointError(f"Checkpoint {path} has kind {file_kind!r}; this towers reads {sorted(_REQUIRED)}. "
                              "Upgrade towers to read it.")
    missing = [k for k in _REQUIRED[file_kind] if k not in state]
    if missing:
        raise CheckpointError(f"Checkpoint {path} is incomplete: it lacks {missing}. It was not written by "
                              "towers.checkpoint.save_checkpoint; restore an older checkpoint.")
    return state


def check_model_state(model: nn.Module, state: Mapping[str, torch.Tensor], *,
                      path: str | os.PathLike[str] = "<state>") -> None:
    """Raise ``CheckpointError`` (naming missing, unexpected and mis-shaped keys) unless ``state`` fits ``model``."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"Checkpoint {path} holds no model state_dict (found {type(state).__name__}).")
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in sorted(set(own) & set(state))
              if hasattr(state[k], "shape") and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        parts = [f"missing keys {missing[:5]}" if missing else "", f"unexpected keys {unexpected[:5]}" if unexpected else "",
                 f"shape mismatches {shapes[:3]}" if shapes else ""]
        wrapped = bool(unexpected) and {k.removeprefix("module.") for k in unexpected} == set(missing)
        fix = ("The checkpoint holds a wrapped model's keys ('module.' prefix, e.g. DDP): save through the strategy "
               "(save_checkpoint(..., strategy=strategy)) so the user's own module is saved."
               if wrapped else "Build the same model architecture that wrote the checkpoint.")
        raise CheckpointError(f"Checkpoint {path} does not fit this model: {'; '.join(p for p in parts if p)}. {fix}")


def check_optimizer_state(optimizer: Any, state: Any, *, path: str | os.PathLike[str] = "<state>") -> None:
    """Raise ``CheckpointError`` unless ``state`` has the optimizer's parameter groups and sizes."""
    own = getattr(optimizer, "param_groups", None)
    saved = state.get("param_groups") if isinstance(state, Mapping) else None
    if own is None or saved is None:
        return  # an optimizer that is not a torch.optim.Optimizer checks its own state
    own_sizes, saved_sizes = [len(g["params"]) for g in own], [len(g.get("params", ())) for g in saved]
    if own_sizes != saved_sizes:
        raise CheckpointError(
            f"Checkpoint {path} does not fit this optimizer: parameter groups of sizes {saved_sizes} in the file, "
            f"{own_sizes} in the optimizer. Build the same optimizer (same parameter groups) that wrote it.")


def load_model_state(model: nn.Module, state: Mapping[str, torch.Tensor], *,
                     path: str | os.PathLike[str] = "<state>") -> None:
    """Load ``state`` into ``model`` only if every key and shape matches (never a partial load).

    Raises:
        CheckpointError: naming missing, unexpected and mis-shaped keys.
    """
    check_model_state(model, state, path=path)
    model.load_state_dict(state, strict=True)


def restore_checkpoint(path: str | os.PathLike[str], objects: Mapping[str, Any] | None = None, *,
                       strategy: "Strategy | None" = None, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``objects`` and return everything it holds.

    ``objects`` maps keys of the saved dict to live objects: modules (checked key by key and shape
    by shape, never a partial load), optimizers and anything with ``load_state_dict``. Keys of the
    file not in ``objects`` (``"epoch"``, ...) are only returned. Every replica calls it.

    Raises:
        FileNotFoundError: when there is no file at ``path``.
        CheckpointError: when the file is torn or foreign, or lacks a key of ``objects``, or a state
            does not fit its object (naming the key and the mismatch).
    """
    state = load_checkpoint(path, map_location=map_location)
    objects = dict(objects or {})
    missing = [k for k in objects if k not in state]
    if missing:
        held = sorted(k for k in state if k not in _RESERVED)
        raise CheckpointError(f"Checkpoint {path} has no {missing}; it holds {held}. Pass the keys you saved.")
    modules = [k for k, v in objects.items() if isinstance(v, nn.Module)]
    optimizers = [k for k, v in objects.items() if isinstance(v, torch.optim.Optimizer)]
    done: set[str] = set()
    if strategy is not None and len(modules) == 1 and len(optimizers) <= 1:
        key, opt_key = modules[0], (optimizers[0] if optimizers else None)
        check_model_state(strategy.unwrap(objects[key]), state[key], path=path)
        if opt_key is not None:
            check_optimizer_state(objects[opt_key], state[opt_key], path=path)
        strategy.load_state_dict({"model": state[key], "optimizer": state[opt_key] if opt_key else None},
                                 objects[key], objects[opt_key] if opt_key else None)
        done = {key, *([opt_key] if opt_key else [])}
    for key, obj in objects.items():
        if key in done:
            continue
        if isinstance(obj, nn.Module):
            load_model_state(strategy.unwrap(obj) if strategy is not None else obj, state[key], path=path)
        elif isinstance(obj, torch.optim.Optimizer):
            check_optimizer_state(obj, state[key], path=path)
            obj.load_state_dict(state[key])
        elif callable(getattr(obj, "load_state_dict", None)):
            obj.load_state_dict(state[key])
        else:
            raise CheckpointError(f"Cannot restore {key!r} in place: {type(obj).__name__} has no load_state_dict. "
                                  f"Read plain values from the returned dict instead: restore_checkpoint(...)[{key!r}].")
    return state


# The manager builds on the functions above; imported last so that `towers.checkpoint.CheckpointManager` works.
from towers.checkpoint_manager import CheckpointManager  # noqa: E402
