"""Mixed precision: the autocast policy (``"32"``, ``"bf16"``, ``"fp16"``) and fp16 loss scaling.

Parameters stay float32 ("master weights"); only the prepared model's forward runs under
``torch.autocast``, and its floating outputs come back as float32, so losses are computed in
full precision. fp16 needs loss scaling against gradient underflow. To keep the user's
``loss.backward()`` unchanged, towers scales the *gradient flowing into the model's outputs*
(identity in the forward pass, ``x scale`` in the backward pass), which is the same as scaling
the loss for every gradient that reaches the parameters through the model. The optimizer
returned by ``prepare`` unscales, skips the step when any replica saw inf/NaN, and updates the
scale — the same decision on every replica.

CPU: bf16 autocast is supported; fp16 autocast on CPU is supported by recent torch (2.13 here).
When the installed torch cannot autocast to the requested dtype on the device, resolving the
policy raises ``ValueError`` that says so and names the fix, instead of silently running in
another precision.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from towers._logging import get_logger

__all__ = [
    "PRECISIONS",
    "PrecisionPolicy",
    "resolve_precision",
    "make_grad_scaler",
    "MixedPrecisionModule",
    "precision_forward",
    "scaler_step",
]

log = get_logger(__name__)

#: Accepted spellings, by canonical name.
PRECISIONS: dict[str, tuple[str, ...]] = {
    "32": ("32", "fp32", "float32", "32-true"),
    "bf16": ("bf16", "bfloat16", "bf16-mixed"),
    "fp16": ("fp16", "16", "float16", "half", "16-mixed"),
}
_DTYPES = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """How the prepared model's forward runs: ``name`` in ``("32", "bf16", "fp16")`` on ``device_type``."""

    name: str = "32"
    device_type: str = "cpu"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype, or None for full precision."""
        return _DTYPES[self.name]

    @property
    def enabled(self) -> bool:
        """True when the forward runs under autocast."""
        return self.name != "32"

    @property
    def needs_loss_scaling(self) -> bool:
        """True for fp16, whose small gradients underflow without loss scaling."""
        return self.name == "fp16"

    def autocast(self) -> ContextManager[Any]:
        """Return the autocast context of this policy (a no-op context for ``"32"``)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)


def resolve_precision(precision: str | int | None, device: torch.device) -> PrecisionPolicy:
    """Return the policy for ``precision`` on ``device``.

    Raises:
        ValueError: on an unknown name, or a dtype autocast cannot use on this device.
    """
    text = "32" if precision is None else str(precision).strip().lower()
    name = next((canon for canon, spellings in PRECISIONS.items() if text in spellings), None)
    if name is None:
        raise ValueError(
            f"precision must be one of '32', 'bf16' or 'fp16'. Received: {precision!r}. "
            "Use 'bf16' for mixed precision on CPUs and recent GPUs, 'fp16' (with loss scaling) on older GPUs.")
    policy = PrecisionPolicy(name, device.type)
    if policy.enabled:
        _check_autocast(policy)
    return policy


def _check_autocast(policy: PrecisionPolicy) -> None:
    device_type, dtype = policy.device_type, policy.autocast_dtype
    is_available = getattr(torch.amp, "is_autocast_available", lambda _: True)
    if not is_available(device_type):
        raise ValueError(
            f"precision={policy.name!r} needs torch.autocast on {device_type!r}, which this torch build lacks. "
            "Use precision='32' on this device.")
    if device_type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(
            "precision='bf16' needs a GPU with bfloat16 support (Ampere or newer); this one has none. "
            "Use precision='fp16' (with loss scaling) or '32'.")
    # Older torch builds warn "target dtype is not supported" and quietly disable autocast; probe for it.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast(device_type, dtype=dtype):
            try:
                enabled = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == dtype
            except (TypeError, AttributeError):  # torch < 2.4 has no per-device queries: rely on the warning
                enabled = True
    if not enabled or any("not supported" in str(w.message) for w in caught):
        other = "'bf16'" if policy.name == "fp16" else "'32'"
        raise ValueError(
            f"precision={policy.name!r}: torch {torch.__version__} cannot autocast to {dtype} on {device_type!r}. "
            f"Use precision={other} on this device, or upgrade torch.")


def make_grad_scaler(policy: PrecisionPolicy) -> torch.amp.GradScaler | None:
    """Return a ``GradScaler`` for fp16, else None."""
    if not policy.needs_loss_scaling:
        return None
    return torch.amp.GradScaler(policy.device_type)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the incoming gradient by the scaler's scale."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scaler: torch.amp.GradScaler) -> torch.Tensor:  # type: ignore[override]
        ctx.scaler = scaler
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return ctx.scaler.scale(grad), None


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
    return value


def _finish_output(t: torch.Tensor, scaler: torch.amp.GradScaler | None) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    if scaler is not None and t.requires_grad:
        t = _ScaleGrad.apply(t, scaler)
    return t


def precision_forward(forward: Callable[..., Any], policy: PrecisionPolicy, scaler: torch.amp.GradScaler | None,
                      *args: Any, **kwargs: Any) -> Any:
    """Call ``forward`` under ``policy``'s autocast; return float32 outputs (gradient-scaled for fp16)."""
    with policy.autocast():
        out = forward(*args, **kwargs)
    return _map_tensors(out, lambda t: _finish_output(t, scaler))


class MixedPrecisionModule(nn.Module):
    """Runs ``module``'s forward under a precision policy (used where no DDP wrapper exists)."""

    def __init__(self, module: nn.Module, policy: PrecisionPolicy, scaler: torch.amp.GradScaler | None):
        super().__init__()
        self.module = module
        self._policy = policy
        self._scaler = scaler

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Return ``module(*args, **kwargs)`` computed under the precision policy."""
        return precision_forward(self.module, self._policy, self._scaler, *args, **kwargs)


def scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                all_reduce_max: Callable[[torch.Tensor], None] | None) -> bool:
    """Unscale, agree across replicas on inf/NaN, step unless found, update the scale; return True if stepped.

    ``all_reduce_max`` makes every replica's found-inf flag the maximum over replicas, so all of
    them skip (or take) the step together.
    """
    scaler.unscale_(optimizer)
    # GradScaler keeps the per-device inf flags it just computed in its per-optimizer state; they
    # are what scaler.step() and scaler.update() read, so agreeing on them agrees on the decision.
    state = scaler._per_optimizer_states[id(optimizer)]
    found = state["found_inf_per_device"]
    if all_reduce_max is not None:
        for flag in found.values():
            all_reduce_max(flag)
    skipped = bool(sum(v.item() for v in found.values()))
    scaler.step(optimizer)
    scaler.update()
    if skipped:
        log.info("fp16: inf/NaN gradients on some replica; skipped this step and lowered the loss scale to %g",
                 scaler.get_scale())
    return not skipped
