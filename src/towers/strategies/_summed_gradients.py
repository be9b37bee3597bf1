"""Manual gradient accumulation on top of a SUM all-reduce: what torch users write, kept one device's maths.

The habit (torch, DDP, nanoGPT, Accelerate): k batches per update, ``(loss / k).backward()`` on each,
``optimizer.step()`` once; DDP's ``no_sync()`` on all but the last, or not. towers' DDP hook SUMS the
replicas' gradients (each replica's loss is already divided by the global batch). When a synchronised
backward runs while ``p.grad`` still holds the SUM of an earlier one, autograd first adds this replica's
new gradient to that sum and the all-reduce then sums the result: the earlier micro-batches count N times
(DDP's own averaging hook hides this; a sum does not). Found at 2 replicas: 35% off one device, silently.

So before a forward whose backward will be synchronised, gradients that are already a replica-sum are set
aside (and ``p.grad`` zeroed); once that backward's all-reduce has run they are added back. ``p.grad`` is
then ``earlier + new``, the sum a single device accumulates, in the same order. A gradient accumulated
under ``no_sync()`` is this replica's alone and stays in place: the next synchronised backward sums it.
Nothing is copied in the common loop (``zero_grad()`` sets the gradients to None before each forward).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

__all__ = ["SummedGradients"]


def _output_tensors(value: Any) -> Iterable[torch.Tensor]:
    """The tensors requiring grad in a forward's output (a tensor, a tuple or list, a dict or a ModelOutput)."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _output_tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _output_tensors(item)


class SummedGradients:
    """Keeps gradients that already hold a replica-sum out of the next synchronised all-reduce, then adds them back."""

    def __init__(self, module: nn.Module):
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._kept: list[torch.Tensor | None] | None = None  # the sums set aside, per parameter
        self._last_synced = False  # the last forward with gradients on ran a synchronised backward

    def before_forward(self, synced: bool) -> None:
        """Before a forward with gradients on; ``synced``: its backward will all-reduce (SUM) the gradients."""
        if self._last_synced and any(p.grad is not None for p in self._params):
            self._set_aside()  # p.grad is a replica-sum: summing it again would count it N times
        self._last_synced = synced

    def after_forward(self, output: Any) -> None:
        """After a synchronised forward: add the sums set aside back once its backward's all-reduce has run."""
        if self._kept is None:
            return
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
        queued = [False]

        def after_the_all_reduce() -> None:
            # Queued from a callback, so it runs after the callbacks DDP queued in this backward (its all-reduce).
            engine.queue_callback(self.settle)

        def at_backward_start(grad: torch.Tensor) -> torch.Tensor:
            if not queued[0]:
                queued[0] = True
                engine.queue_callback(after_the_all_reduce)
            return grad

        for tensor in _output_tensors(output):
            tensor.register_hook(at_backward_start)

    def settle(self) -> None:
        """Add the sums set aside back into ``p.grad`` (before a step or a clip reads them; idempotent)."""
        kept, self._kept = self._kept, None
        if kept is None:
            return
        for p, grad in zip(self._params, kept):
            if grad is None:
                continue
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)  # float addition commutes: earlier + new, exactly as one device accumulates

    def _set_aside(self) -> None:
        kept = self._kept
        if kept is None:
            kept = [None if p.grad is None else p.grad.detach().clone() for p in self._params]
        else:  # a synchronised forward whose backward never ran (or was not seen): its gradients join the sums
            kept = [old if p.grad is None else (p.grad.detach().clone() if old is None else old.add_(p.grad))
                    for p, old in zip(self._params, kept)]
        for p in self._params:
            if p.grad is not None:
                p.grad.zero_()  # in place: DDP's gradients are views of its buckets
        self._kept = kept
