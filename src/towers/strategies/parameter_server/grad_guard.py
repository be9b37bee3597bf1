"""Notice user code that changes a worker's gradients between backward and the push (torch's ``clip_grad_norm_``).

On a parameter-server worker ``p.grad`` is this worker's SHARE of the step's gradient: the ps tasks
add the workers' shares. A global-norm clip (``torch.nn.utils.clip_grad_norm_``, which nanoGPT, Hugging
Face loops and torchtitan call) or any rescaling measured on ``p.grad`` there sees the share, not the
gradient, and would train something else in silence. Each gradient's version counter is noted when
backward accumulates it; a push that finds it changed since is refused with the fix.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from towers.errors import user_error

__all__ = ["GradientGuard"]


class GradientGuard:
    """Refuses a push whose gradients user code changed in place after backward."""

    def __init__(self, parameters: Iterable[torch.Tensor], expected_changes: Callable[[], int] = lambda: 0):
        #: towers' own in-place changes since backward (the division of a weighted loss, as backward ends).
        self._expected_changes = expected_changes
        self._seen: dict[int, tuple[torch.Tensor, int]] = {}
        for p in parameters:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._note)

    def _note(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._seen[id(p)] = (p, p.grad._version)

    def check(self) -> None:
        """Raise when a gradient changed since backward accumulated it; forget what was noted (the next step notes anew).

        Raises:
            ValueError: a gradient was changed in place after backward.
        """
        allowed = self._expected_changes()
        seen, self._seen = self._seen, {}
        changed = sum(1 for p, version in seen.values() if p.grad is not None and p.grad._version > version + allowed)
        if changed:
            raise user_error(
                "The gradients were changed in place between backward and optimizer.step() (torch.nn.utils."
                "clip_grad_norm_, or a rescale measured on p.grad): under ParameterServerStrategy p.grad on a worker is "
                "its SHARE of the step's gradient (the ps tasks add the workers' shares), so a norm taken there is not "
                "the gradient's and the clip would train something else",
                f"{changed} changed gradient(s)",
                "Leave p.grad as backward made it; for global-norm clipping use MirroredStrategy, FullyShardedStrategy "
                "or HybridStrategy (every worker holds the summed dense gradient there) with strategy.clip_grad_norm_ "
                "or torch's own clip.")
