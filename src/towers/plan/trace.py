"""One replica's training step traced on fake tensors: how many bytes are live at each moment, without allocating any.

The model (built on the meta device) is given fake CPU tensors (``FakeTensorMode``), then two
steps run (forward, loss, backward, ``optimizer.step()``, ``zero_grad()``): the first creates the
optimizer's state, the second is the one measured. A ``TorchDispatchMode`` sees every tensor an
operation returns and keeps a weak reference to its storage, so a storage counts from the op
that made it until the last tensor on it is gone: exactly when the real allocator would free it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["StepTrace", "trace_step", "make_optimizer", "OPTIMIZERS"]

#: Optimizers the plan knows, by name; each is built as torch builds it, over the model's parameters.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    """Return the optimizer ``name`` (one of ``OPTIMIZERS``) over ``params``."""
    return OPTIMIZERS[name](params)


@dataclass(frozen=True)
class StepTrace:
    """Bytes one replica holds during a steady-state step, beyond its parameters and optimizer state.

    ``activations``: the most bytes live during forward and backward that are not gradients (saved
    activations, the batch, temporaries). ``with_gradients``: the most bytes live during forward and
    backward counting the gradients as they are made (a replica without gradient buckets).
    ``optimizer_temporaries``: the most bytes ``optimizer.step()`` adds while it runs. ``gradients``:
    the gradients' bytes after backward.
    """

    activations: int
    with_gradients: int
    optimizer_temporaries: int
    gradients: int


class _LiveBytes(TorchDispatchMode):
    """Logs ``(bytes, storage serial)`` when an op returns a tensor on a new storage, and ``(-bytes, serial)`` when it dies."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []
        self._serials: dict[int, int] = {}  # id of a live storage -> its serial (ids are reused, serials are not)

    def _died(self, key: int, serial: int, nbytes: int) -> None:
        self._serials.pop(key, None)
        self.events.append((-nbytes, serial))

    def serial(self, tensor: torch.Tensor) -> int | None:
        """Return the serial of ``tensor``'s storage, None when no traced op made it."""
        return self._serials.get(id(tensor.untyped_storage()))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._serials:
                    serial, nbytes = len(self.events), storage.nbytes()
                    self._serials[key] = serial
                    self.events.append((nbytes, serial))
                    weakref.finalize(storage, self._died, key, serial, nbytes)
        return out


def _peak(events: list[tuple[int, int]], skip: set[int] = frozenset()) -> tuple[int, int]:  # type: ignore[assignment]
    """Return (most bytes live at once, bytes live at the end) over ``events``, leaving out the storages in ``skip``."""
    live = peak = 0
    for nbytes, serial in events:
        if serial not in skip:
            live += nbytes
            peak = max(peak, live)
    return peak, live


def _loss(output: Any, loss: str) -> torch.Tensor:
    """The loss of one batch, against random targets shaped for ``output`` (class ids or the output's shape)."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    elif not isinstance(output, torch.Tensor):
        output = output["logits"] if "logits" in output else next(iter(output.values()))
    output = output.float()  # as the strategies hand back mixed-precision outputs
    if loss == "mse":
        return F.mse_loss(output, torch.zeros_like(output))
    logits = output.reshape(-1, output.shape[-1])
    return F.cross_entropy(logits, torch.randint(0, output.shape[-1], (logits.shape[0],)))


def trace_step(model: nn.Module, make_batch: Callable[[], Any], *, optimizer: str, loss: str,
               autocast_dtype: torch.dtype | None) -> StepTrace:
    """Run two training steps of ``model`` (on the meta device; it is moved to fake tensors) and return the second's bytes.

    ``make_batch()`` returns the model's input (a tensor, or a dict of keyword arguments); it is
    called under fake tensors, so it allocates nothing.
    """
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
        params = [p for p in model.parameters() if p.requires_grad]
        tracker = _LiveBytes()
        with tracker:
            for _ in range(2):  # the first step makes the optimizer's state; the second is the steady state
                first = len(tracker.events)
                batch = make_batch()
                with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                    output = model(**batch) if isinstance(batch, dict) else model(batch)
                _loss(output, loss).backward()
                del output, batch
                grads = {s for s in (tracker.serial(p.grad) for p in params if p.grad is not None) if s is not None}
                backward = tracker.events[first:]
                stepped = len(tracker.events)
                opt.step()
                step = tracker.events[stepped:]
                opt.zero_grad(set_to_none=True)
    with_gradients, _ = _peak(backward)
    activations, _ = _peak(backward, grads)
    gradients = sum(nbytes for nbytes, serial in backward if serial in grads and nbytes > 0)
    return StepTrace(activations=activations, with_gradients=with_gradients,
                     optimizer_temporaries=_peak(step)[0], gradients=gradients)
