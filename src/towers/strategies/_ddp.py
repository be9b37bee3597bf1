"""Wrapping a module in DDP for the mirrored strategies, with checks that turn DDP's failures into clear errors."""

from __future__ import annotations

from typing import Any, Callable, Mapping, SupportsIndex

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from towers.errors import InvalidArgumentError
from towers.strategies._copies import copy_of_wrapped, reduce_of_wrapped
from towers.strategies._summed_gradients import SummedGradients
from towers.strategies.precision import Precision, precision_forward

__all__ = ["TowersDDP", "check_same_parameters", "unused_parameters_error", "UNUSED_FIX"]

UNUSED_FIX = ("Fix: use every parameter in the forward pass of every step, set requires_grad=False on the ones "
              "you do not train, remove them from the model, or pass find_unused_parameters=True to the strategy "
              "(slower: DDP then searches the graph every step).")


def _signature(module: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]


def check_same_parameters(module: nn.Module, all_gather_object: Callable[[Any], list[Any]]) -> None:
    """Check that every replica holds parameters of the same names, shapes and dtypes.

    Raises:
        ValueError: on every replica, naming the first differing parameter and the ranks.
    """
    signatures = all_gather_object(_signature(module))
    reference = signatures[0]
    for rank, signature in enumerate(signatures[1:], start=1):
        if signature == reference:
            continue
        for i in range(max(len(reference), len(signature))):
            ours = reference[i] if i < len(reference) else None
            theirs = signature[i] if i < len(signature) else None
            if ours != theirs:
                break

        def describe(entry: tuple[str, tuple[int, ...], str] | None) -> str:
            return "no parameter" if entry is None else f"{entry[0]!r} with shape {list(entry[1])} ({entry[2]})"

        raise InvalidArgumentError(
            f"The model differs across replicas: parameter #{i} is {describe(ours)} on rank 0 but "
            f"{describe(theirs)} on rank {rank} ({len(reference)} vs {len(signature)} parameters). "
            "Every replica must build the same model: do not make layer sizes depend on the rank or on "
            "per-replica data.")


def unused_parameters_error(names: list[str]) -> InvalidArgumentError:
    """Return the error for parameters that got no gradient in a step."""
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    return InvalidArgumentError(
        f"{len(names)} parameter(s) received no gradient in this step: {shown}. DDP (MirroredStrategy) "
        f"all-reduces every parameter's gradient each step and waits for all of them. {UNUSED_FIX}")


class TowersDDP(DistributedDataParallel):
    """DDP whose forward runs under the strategy's precision policy and explains DDP's unused-parameter error.

    Its gradient all-reduce is a SUM (the strategies' hook); gradients accumulated over several synchronised
    backwards (a user's own accumulation, with or without ``no_sync()``) stay one device's (``SummedGradients``).
    """

    def __init__(self, module: nn.Module, *, precision: Precision, **ddp_kwargs: Any):
        # Gradients as views of the all-reduce buckets: one copy less per bucket and step.
        ddp_kwargs.setdefault("gradient_as_bucket_view", True)
        super().__init__(module, **ddp_kwargs)
        self._towers_precision = precision
        self.towers_forward_calls = 0
        #: The strategy turned the all-reduce off for its own accumulation window (and turns it back on).
        self.towers_paused_sync = False
        self._towers_summed = SummedGradients(module)

    def settle_gradients(self) -> None:
        """Make ``p.grad`` the update's whole gradient (sums set aside during a manual accumulation added back)."""
        self._towers_summed.settle()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Return the wrapped module's output (float32 floats under mixed precision)."""
        self.towers_forward_calls += 1
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        if torch.is_grad_enabled():
            self._towers_summed.before_forward(synced)
        try:
            if not self._towers_precision.enabled:
                output = super().forward(*args, **kwargs)
            else:
                output = precision_forward(super().forward, self._towers_precision, *args, **kwargs)
            if synced:
                self._towers_summed.after_forward(output)
            return output
        except RuntimeError as exc:
            if "Expected to have finished reduction" not in str(exc):
                raise
            names = [n for n, p in self.module.named_parameters() if p.requires_grad and p.grad is None]
            detail = f" Parameters without a gradient here: {', '.join(names[:10])}." if names else ""
            raise InvalidArgumentError(
                "The previous step left some parameters without a gradient, so DDP (MirroredStrategy) could not "
                f"finish its gradient all-reduce.{detail} {UNUSED_FIX}") from None

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        """A copy of the prepared model is a plain copy of the user's module (no DDP, no hooks of the strategy)."""
        return copy_of_wrapped(self.module, memo)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        """Pickled, the prepared model is the user's module: what a process without the job's group loads."""
        return reduce_of_wrapped(self.module, protocol)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The user's module's ``state_dict()``: the names one device saves (DDP's own adds ``module.`` to each).

        ``torch.save(model.state_dict(), path)`` then loads into the plain model, as it does without towers.
        """
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict saved from the plain model (or with DDP's ``module.`` prefix) into the user's module."""
        if state_dict and all(key.startswith("module.") for key in state_dict):
            state_dict = {key[len("module."):]: value for key, value in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
