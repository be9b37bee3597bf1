"""The precision a strategy owns: ``"32"``, ``"bf16"`` or ``"fp16"`` (with dynamic loss scaling).

Parameters stay float32 ("master weights"); only the prepared model's forward runs under
``torch.autocast`` and its floating outputs come back as float32, so losses are computed in
full precision. fp16 needs loss scaling against gradient underflow: ``strategy.backward(loss)``
multiplies the *whole* loss the user backpropagates by the scale (penalties added outside the
model included), ``strategy.clip_grad_norm_`` unscales first, and the prepared optimizer unscales
(once), skips the update when any replica saw inf/NaN and adjusts the scale — the same decision,
and so the same scale, on every replica. Under fp16 a plain ``loss.backward()`` would leave the
gradients unscaled; the prepared optimizer refuses that step and names the fix.

When the installed torch cannot autocast to the requested dtype on the device, resolving the
precision raises ``ValueError`` that says so and names the fix, instead of silently running in
another precision.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, ContextManager, Mapping, SupportsIndex

import torch
from torch import nn

from towers._logging import get_logger
from towers.data import map_tensors
from towers.errors import FailedPreconditionError, InvalidArgumentError
from towers.strategies._copies import copy_of_wrapped, reduce_of_wrapped

__all__ = ["PRECISIONS", "Precision", "resolve_precision", "MixedPrecisionModule", "precision_forward"]

log = get_logger(__name__)

#: Accepted spellings, by canonical name.
PRECISIONS: dict[str, tuple[str, ...]] = {
    "32": ("32", "fp32", "float32", "32-true"),
    "bf16": ("bf16", "bfloat16", "bf16-mixed"),
    "fp16": ("fp16", "16", "float16", "half", "16-mixed"),
}
_DTYPES = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """How a strategy computes: autocast of the prepared model's forward, and fp16 loss scaling.

    ``init_scale``, ``growth_factor``, ``backoff_factor`` and ``growth_interval`` are the dynamic
    loss scale's settings (fp16 only; torch's GradScaler defaults).
    """

    def __init__(self, name: str = "32", device_type: str = "cpu", *, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000):
        if name not in _DTYPES:
            raise InvalidArgumentError(f"Precision name must be one of {sorted(_DTYPES)}. Received: {name!r}. "
                                       "Build it with towers.strategies.precision.resolve_precision(...).")
        self.name = name
        self.device_type = device_type
        self.scale = float(init_scale)
        self._growth_factor, self._backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._good_steps = 0
        self._scaled_backward = False  # strategy.backward ran since the last step
        self._unscaled: set[int] = set()  # optimizers whose gradients were unscaled since their last step
        self._found = torch.zeros(1)  # this replica's inf/NaN flag from the last unscale

    # --- what it is ------------------------------------------------------------------------------
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

    def forward_context(self) -> ContextManager[Any]:
        """Return the autocast context of the prepared model's forward (a no-op context for ``"32"``)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    # --- backward and step -----------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Return the loss to backpropagate: ``loss * scale`` under fp16, ``loss`` itself otherwise."""
        if not self.needs_loss_scaling:
            return loss
        self._scaled_backward = True
        return loss * self.scale

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """Divide ``optimizer``'s gradients by the scale (once per step); return this replica's inf/NaN flag.

        Returns None when nothing is scaled (not fp16) or the gradients were already unscaled this step.
        """
        if not self.needs_loss_scaling or id(optimizer) in self._unscaled:
            return None
        self._unscaled.add(id(optimizer))
        # A sharded gradient (DTensor) is unscaled and checked in this rank's shard; the flag's maximum
        # over the replicas (optimizer_step) then covers every shard.
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        found = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
        inv = 1.0 / self.scale
        for grad in grads:
            grad.mul_(inv)
            found += (~torch.isfinite(grad)).any().to(found.dtype)
        self._found = found
        return found

    def optimizer_step(self, optimizer: torch.optim.Optimizer, *,
                       all_reduce_max: Callable[[torch.Tensor], None] | None = None,
                       closure: Callable[[], Any] | None = None) -> bool:
        """Step ``optimizer`` unless fp16 gradients hold inf/NaN on any replica; return True if it stepped.

        ``all_reduce_max`` makes the inf/NaN flag the maximum over replicas, so every replica takes
        the same decision and keeps the same scale.

        Raises:
            RuntimeError: under fp16 when no ``strategy.backward(loss)`` ran since the last step.
            ValueError: a ``closure`` under fp16.
        """
        if not self.needs_loss_scaling:
            if closure is not None:
                optimizer.step(closure)
            else:
                optimizer.step()
            return True
        if closure is not None:
            raise InvalidArgumentError("optimizer.step(closure) is not supported with precision='fp16'. Call step() without a "
                                       "closure, after strategy.backward(loss).")
        if not self._scaled_backward:
            raise FailedPreconditionError(
                "precision='fp16' scales the loss before backward, but no strategy.backward(loss) ran since the last "
                "optimizer step, so the gradients were never scaled (and small ones underflow). Expected "
                "`strategy.backward(loss)` instead of `loss.backward()` in the step function.")
        fresh = self.unscale_gradients(optimizer)
        found = fresh if fresh is not None else self._found
        if all_reduce_max is not None:
            all_reduce_max(found)
        skipped = bool(found.item() > 0)
        if not skipped:
            optimizer.step()
        self._update(skipped)
        self._unscaled.discard(id(optimizer))
        self._scaled_backward = False
        return not skipped

    def _update(self, skipped: bool) -> None:
        if skipped:
            self.scale *= self._backoff_factor
            self._good_steps = 0
            log.info("fp16: inf/NaN gradients on some replica; skipped this step and lowered the loss scale to %g",
                     self.scale)
            return
        self._good_steps += 1
        if self._good_steps >= self._growth_interval:
            self.scale *= self._growth_factor
            self._good_steps = 0

    # --- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Return the loss scale's state (``{}`` unless fp16)."""
        if not self.needs_loss_scaling:
            return {}
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (ignored unless fp16)."""
        if self.needs_loss_scaling and state:
            self.scale = float(state["scale"])
            self._good_steps = int(state.get("good_steps", 0))

    def __repr__(self) -> str:
        extra = f", scale={self.scale:g}" if self.needs_loss_scaling else ""
        return f"Precision({self.name!r}, {self.device_type!r}{extra})"


def resolve_precision(precision: str | int | Precision | None, device: torch.device) -> Precision:
    """Return the ``Precision`` for ``precision`` (a name or spelling) on ``device``.

    Raises:
        ValueError: on an unknown name, or a dtype autocast cannot use on this device.
    """
    if isinstance(precision, Precision):
        return precision
    text = "32" if precision is None else str(precision).strip().lower()
    name = next((canon for canon, spellings in PRECISIONS.items() if text in spellings), None)
    if name is None:
        raise InvalidArgumentError(
            f"precision must be one of '32', 'bf16' or 'fp16'. Received: {precision!r}. "
            "Use 'bf16' for mixed precision on CPUs and recent GPUs, 'fp16' (with loss scaling) on older GPUs.")
    result = Precision(name, device.type)
    if result.enabled:
        _check_autocast(result)
    return result


def _check_autocast(precision: Precision) -> None:
    device_type, dtype = precision.device_type, precision.autocast_dtype
    is_available = getattr(torch.amp, "is_autocast_available", lambda _: True)
    if not is_available(device_type):
        raise InvalidArgumentError(
            f"precision={precision.name!r} needs torch.autocast on {device_type!r}, which this torch build lacks. "
            "Use precision='32' on this device.")
    if device_type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise InvalidArgumentError(
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
        other = "'bf16'" if precision.name == "fp16" else "'32'"
        raise InvalidArgumentError(
            f"precision={precision.name!r}: torch {torch.__version__} cannot autocast to {dtype} on {device_type!r}. "
            f"Use precision={other} on this device, or upgrade torch.")


def _to_float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def precision_forward(forward: Callable[..., Any], precision: Precision, *args: Any, **kwargs: Any) -> Any:
    """Call ``forward`` under ``precision``'s autocast; return its outputs with half floats made float32."""
    with precision.forward_context():
        out = forward(*args, **kwargs)
    return map_tensors(out, _to_float32)


class MixedPrecisionModule(nn.Module):
    """Runs ``module``'s forward under a precision (used where no DDP wrapper exists)."""

    def __init__(self, module: nn.Module, precision: Precision):
        super().__init__()
        self.module = module
        self._precision = precision

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Return ``module(*args, **kwargs)`` computed under the precision."""
        return precision_forward(self.module, self._precision, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        """A copy of the prepared model is a plain copy of the user's module (float32, no hooks of the strategy)."""
        return copy_of_wrapped(self.module, memo)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        """Pickled, the prepared model is the user's module."""
        return reduce_of_wrapped(self.module, protocol)
