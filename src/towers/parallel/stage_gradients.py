"""Notice torch's own ``clip_grad_norm_`` (or any in-place change of ``p.grad``) on a pipeline stage.

Under pipeline parallelism each process holds one stage: ``p.grad`` there is the whole model's gradient
for that stage's parameters only. torch's ``clip_grad_norm_`` (nanoGPT, Hugging Face loops and torchtitan
call it) measures the norm of what it is given, so every stage clips by its own norm and scales by its own
factor: another update than one device's, in silence (seen: 0.805 on a stage where the model's norm is
1.291). ``strategy.clip_grad_norm_`` takes the norm over every stage instead. When ``forward_backward``
returns (and after towers' own clip) each gradient's version counters (the DTensor's and its shard's) and
norm are noted; an optimizer step that finds one changed since, on any stage, is refused on every stage
with that fix. (The norms are there because torch's foreach kernels, its clip's path on GPUs, leave a
DTensor's version counters as they were.) Tensor parallelism alone and sharded data parallelism need no
guard: their gradients are DTensors on one mesh, whose norm torch takes whole.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from towers.errors import user_error

__all__ = ["StageGradientGuard"]

_PIPELINE = ("under pipeline parallelism each process holds one stage, so a norm taken there is that stage's, not the "
             "model's, and every stage would scale its gradients by a factor of its own")
_PIPELINE_ASIDE = ("Without pp (tensor parallelism, sharded or mirrored replicas) torch's own clip sees the whole gradient "
                   "and works as written.")


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The tensor whose version counter an in-place change bumps (a DTensor's local shard)."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _state(grads: list[torch.Tensor]) -> tuple[list[tuple[int, int]], torch.Tensor | None]:
    """Each gradient's version counters (its own and its shard's) and their norms, in one tensor."""
    with torch.no_grad():
        locals_ = [_local(g) for g in grads]
        versions = [(g._version, local._version) for g, local in zip(grads, locals_)]
        norms = torch.stack(torch._foreach_norm(locals_)) if locals_ else None
    return versions, norms


class StageGradientGuard:
    """Refuses an optimizer step whose stage gradients user code changed in place after ``forward_backward``."""

    def __init__(self, mesh: str, any_stage: Callable[[bool], bool], *, situation: str = _PIPELINE,
                 aside: str = _PIPELINE_ASIDE, after: str = "strategy.forward_backward"):
        self._mesh = mesh
        self._situation, self._aside, self._after = situation, aside, after
        self._any_stage = any_stage  # True on every stage when it is True on one (a collective over the stages)
        self._seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._versions: list[tuple[int, int]] = []
        self._norms: torch.Tensor | None = None

    def note(self, parameters: Iterable[torch.Tensor]) -> None:
        """Note every gradient of ``parameters`` as it is now (final for this backward)."""
        self._seen = [(p, p.grad) for p in parameters if p.grad is not None]
        self._versions, self._norms = _state([g for _, g in self._seen])

    def check(self) -> None:
        """Raise, on every stage, when a noted gradient changed in place since on any; forget what was noted.

        Raises:
            ValueError: a gradient was changed in place after ``forward_backward``.
        """
        seen, versions, norms = self._seen, self._versions, self._norms
        self._seen, self._versions, self._norms = [], [], None
        grads = [g for p, g in seen if p.grad is g]  # a gradient replaced (set to None, reassigned) is not a clip
        kept = [v for (p, g), v in zip(seen, versions) if p.grad is g]
        now, now_norms = _state(grads)
        changed = sum(1 for a, b in zip(now, kept) if a != b)
        if not changed and norms is not None and now_norms is not None and len(grads) == len(seen):
            changed = int((now_norms != norms).sum())
        if self._any_stage(changed > 0):
            raise user_error(
                f"The gradients were changed in place between {self._after} and optimizer.step() (torch.nn."
                f"utils.clip_grad_norm_, or a rescale measured on p.grad): {self._situation}",
                f"gradients changed in place on a process of mesh {self._mesh} ({changed} on this process)",
                "Clip with strategy.clip_grad_norm_(model.parameters(), max_norm) instead (the same arguments and "
                f"return value: the whole model's norm, one factor for all). {self._aside}")
