"""Export the plain module's full weights for inference, from any strategy; load them without towers.

``export_model(model, "model.safetensors", strategy=strategy)`` gathers the full (unsharded)
weights of the user's module — from shards, parameter servers or a replica — and the chief writes
them in one file, atomically: safetensors for a ``.safetensors`` path (and for a path without a
known suffix when the package is installed), otherwise a plain ``torch.save`` of a dict of
tensors, which ``torch.load(path, weights_only=True)`` reads. Either loads into the plain
``nn.Module`` with ``model.load_state_dict(...)``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from towers.checkpoint.state import CheckpointError, flatten

__all__ = ["export_model", "load_exported"]

_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


class _Exporting(Protocol):
    @property
    def is_chief(self) -> bool: ...
    def full_state_dict(self, model: nn.Module) -> dict[str, Any]: ...
    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...


def _format(path: Path) -> str:
    if path.suffix == ".safetensors":
        if importlib.util.find_spec("safetensors") is None:
            raise CheckpointError(f"Cannot export to {path}: the safetensors package is not installed. Install it "
                                  "(pip install safetensors), or export to a .pt path (a weights_only torch file).")
        return "safetensors"
    if path.suffix in _TORCH_SUFFIXES or importlib.util.find_spec("safetensors") is None:
        return "torch"
    return "safetensors"


def _flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    # Nested entries (a parameter-server table's rows: ids, weight, slots) become "<key>.<field>".
    out = {}
    for path, tensor in flatten(state):
        out[".".join(str(p) for p in path)] = tensor.detach().to("cpu").clone().contiguous()  # no shared storage
    return out


def export_model(model: nn.Module, path: str | os.PathLike[str], *, strategy: _Exporting | None = None) -> Path:
    """Write the full weights of the user's module in ``model`` to ``path`` for inference; return the path.

    Every process calls it (gathering shards is a collective); the chief writes the file.

    Args:
        model: the prepared (or plain) model; its user module's weights are written whole.
        path: the file: a ``.safetensors`` path writes safetensors (needs the package), a ``.pt``-like one a
            ``torch.save`` of a dict; another suffix safetensors when the package is installed.
        strategy: the job's strategy, which gathers sharded weights. None: the model as it is.

    Returns:
        ``path``, as a ``Path``.

    Raises:
        CheckpointError: when ``.safetensors`` is asked for without the package.
        OSError: on every process, when the chief cannot write the file.
    """
    path = Path(path)
    fmt = _format(path)
    state = strategy.full_state_dict(model) if strategy is not None else model.state_dict()
    error = None
    if strategy is None or strategy.is_chief:
        tensors = _flat(state)
        tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if fmt == "safetensors":
                from safetensors.torch import save_file

                save_file(tensors, str(tmp), metadata={"format": "pt", "written_by": "towers"})
            else:
                torch.save(tensors, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except Exception as exc:  # every process learns of it below
            with contextlib.suppress(OSError):
                tmp.unlink()
            error = f"{type(exc).__name__}: {exc}"
    if strategy is not None:
        error = strategy.broadcast_object(error, 0)
    if error is not None:
        raise OSError(f"Could not export the model to {path}: {error}. Check the directory and free space.")
    return path


def load_exported(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Return the ``{name: tensor}`` that ``export_model`` wrote (safetensors or torch, by the file's content).

    Args:
        path: the file ``export_model`` wrote.

    Returns:
        The weights by parameter name, on the CPU; ``model.load_state_dict`` takes them.

    Example:
        ```python
        import torch
        from towers.checkpoint import export_model, load_exported

        model = torch.nn.Linear(3, 1)
        export_model(model, "model.pt")
        fresh = torch.nn.Linear(3, 1)
        fresh.load_state_dict(load_exported("model.pt"))
        assert torch.equal(fresh.weight, model.weight)
        ```
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:2] == b"PK":  # a torch.save zip file
        return dict(torch.load(path, map_location="cpu", weights_only=True))
    from safetensors.torch import load_file

    return dict(load_file(str(path)))
