"""DDP communication hooks that SUM gradients across replicas (DDP's own hooks average them).

Each replica's loss is already divided by the GLOBAL batch size (``compute_average_loss``), so
the sum of the replicas' gradients is exactly the single-device gradient of the global batch.
Averaging would divide by the number of replicas a second time.

* ``"none"``: all-reduce SUM of each bucket.
* ``"fp16"`` / ``"bf16"``: cast the bucket, all-reduce SUM, cast back (half the bytes on the wire).
* ``"powersgd"``: torch's PowerSGD (low-rank, error feedback), fed the bucket times the number of
  replicas, because its all-reduces divide by it.

With a ``StepCheck`` one bucket of every synchronised step (the smallest) also carries the step's
identity (``_step_check.py``): appended to the bucket's all-reduce (a few elements more), or, under
PowerSGD, whose collectives are its own, in one small all-reduce of its own just before them.

Every all-reduce runs over ``group``: the default group (every process a replica), or the replicas'
group under a tensor-parallel mesh (each process sums with the processes holding the same slices).
"""

# No `from __future__ import annotations` here: DDP checks that a hook's ``bucket`` annotation *is*
# dist.GradBucket, which a string annotation is not.
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from towers._logging import get_logger
from towers.errors import InvalidArgumentError
from towers.strategies._step_check import StepCheck, folded_sum

__all__ = ["COMPRESSIONS", "register_sum_hook", "sum_hook"]

log = get_logger(__name__)

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def _all_reduce(tensor: torch.Tensor, group: Any = None) -> torch.futures.Future[Any]:
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()  # type: ignore[union-attr]


def _all_reduce_over(group: Any) -> Callable[[torch.Tensor], torch.futures.Future[Any]]:
    return lambda tensor: _all_reduce(tensor, group)


@dataclass(frozen=True)
class _Checked:
    """The checked hook's state: the step identities it carries and the group it sums over (None: the default)."""

    check: StepCheck
    group: Any = None


def sum_hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: SUM the bucket over ``process_group`` (never divide: the losses are / global batch)."""
    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _carries(check: StepCheck, bucket: dist.GradBucket) -> bool:
    return check.carries(bucket.index(), bucket.buffer().numel(), bucket.is_last())


def _checked_sum_hook(state: _Checked, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``sum_hook`` over ``state.group``, one bucket carrying the step's identity."""
    if _carries(state.check, bucket):
        return folded_sum(state.check, bucket.buffer(), bucket.buffer().dtype, _all_reduce_over(state.group))
    return sum_hook(state.group, bucket)


def _compressed_sum_hook(dtype: torch.dtype, check: StepCheck | None = None) -> Hook:
    def hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if check is not None and _carries(check, bucket):  # the cast copies anyway: the identity costs no copy more
            return folded_sum(check, buffer, dtype, _all_reduce_over(process_group))
        compressed = buffer.to(dtype)
        fut = dist.all_reduce(compressed, group=process_group, async_op=True).get_future()

        def decompress(f: torch.futures.Future[Any]) -> torch.Tensor:
            buffer.copy_(f.value()[0])
            return buffer

        return fut.then(decompress)

    hook.__name__ = f"{dtype}_sum_hook".replace("torch.", "")
    return hook


def _powersgd_sum_hook(num_replicas: int, check: StepCheck | None, group: Any = None) -> Hook:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        bucket.buffer().mul_(num_replicas)  # PowerSGD averages; pre-scaling turns its mean into our sum
        if check is not None and _carries(check, bucket):  # before PowerSGD's own collectives, on every replica alike
            identity, mark = check.mark(torch.float32, bucket.buffer().device)
            check.compare_after_backward(identity, _all_reduce(mark, group), 0)
        return powerSGD_hook(state, bucket)

    return hook


def check_compression(name: str | None) -> str:
    """Return the canonical compression name.

    Raises:
        ValueError: naming the accepted values.
    """
    key = "none" if name in (None, False) else str(name).lower()
    if key not in COMPRESSIONS:
        raise InvalidArgumentError(
            f"gradient_compression must be one of {COMPRESSIONS[1:]} or None. Received: {name!r}. "
            "'fp16'/'bf16' halve the bytes sent; 'powersgd' sends a low-rank approximation.")
    return key


def register_sum_hook(model: DistributedDataParallel, compression: str, num_replicas: int, *,
                      powersgd_rank: int = 1, powersgd_start_iter: int = 10, check: StepCheck | None = None,
                      group: Any = None) -> None:
    """Make ``model``'s gradient all-reduce a SUM over ``group`` (None: the default group; pass DDP's
    ``process_group`` when it has one), optionally compressed; with ``check``, carrying the step's identity."""
    compression = check_compression(compression)
    if compression == "none":
        if check is None:
            model.register_comm_hook(group, sum_hook)
        else:
            model.register_comm_hook(_Checked(check, group), _checked_sum_hook)
    elif compression in ("fp16", "bf16"):
        model.register_comm_hook(group, _compressed_sum_hook(torch.float16 if compression == "fp16" else torch.bfloat16,
                                                             check))
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        if powersgd_start_iter < 2:  # torch's PowerSGD needs 2 plain steps to build its DDP buckets
            log.warning("powersgd_start_iter=%d raised to 2: PowerSGD starts after at least 2 plain all-reduce "
                        "steps.", powersgd_start_iter)
        state = PowerSGDState(process_group=group, matrix_approximation_rank=powersgd_rank,
                              start_powerSGD_iter=max(2, powersgd_start_iter))
        model.register_comm_hook(state, _powersgd_sum_hook(num_replicas, check, group))
    log.debug("gradient all-reduce: SUM, compression=%s, step identity %s", compression,
              "checked" if check is not None else "not checked")
