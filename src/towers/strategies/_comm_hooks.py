"""DDP communication hooks that SUM gradients across replicas (DDP's own hooks average them).

Each replica's loss is already divided by the GLOBAL batch size (``compute_average_loss``), so
the sum of the replicas' gradients is exactly the single-device gradient of the global batch.
Averaging would divide by the number of replicas a second time.

* ``"none"``: all-reduce SUM of each bucket.
* ``"fp16"`` / ``"bf16"``: cast the bucket, all-reduce SUM, cast back (half the bytes on the wire).
* ``"powersgd"``: torch's PowerSGD (low-rank, error feedback), fed the bucket times the number of
  replicas, because its all-reduces divide by it.
"""

# No `from __future__ import annotations` here: DDP checks that a hook's ``bucket`` annotation *is*
# dist.GradBucket, which a string annotation is not.
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from towers._logging import get_logger

__all__ = ["COMPRESSIONS", "register_sum_hook"]

log = get_logger(__name__)

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def _sum_hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _compressed_sum_hook(dtype: torch.dtype) -> Hook:
    def hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        compressed = buffer.to(dtype)
        fut = dist.all_reduce(compressed, group=process_group, async_op=True).get_future()

        def decompress(f: torch.futures.Future[Any]) -> torch.Tensor:
            buffer.copy_(f.value()[0])
            return buffer

        return fut.then(decompress)

    hook.__name__ = f"{dtype}_sum_hook".replace("torch.", "")
    return hook


def _powersgd_sum_hook(num_replicas: int) -> Hook:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        bucket.buffer().mul_(num_replicas)  # PowerSGD averages; pre-scaling turns its mean into our sum
        return powerSGD_hook(state, bucket)

    return hook


def check_compression(name: str | None) -> str:
    """Return the canonical compression name.

    Raises:
        ValueError: naming the accepted values.
    """
    key = "none" if name in (None, False) else str(name).lower()
    if key not in COMPRESSIONS:
        raise ValueError(
            f"gradient_compression must be one of {COMPRESSIONS[1:]} or None. Received: {name!r}. "
            "'fp16'/'bf16' halve the bytes sent; 'powersgd' sends a low-rank approximation.")
    return key


def register_sum_hook(model: DistributedDataParallel, compression: str, num_replicas: int, *,
                      powersgd_rank: int = 1, powersgd_start_iter: int = 10) -> None:
    """Make ``model``'s gradient all-reduce a SUM, optionally compressed."""
    compression = check_compression(compression)
    if compression == "none":
        model.register_comm_hook(None, _sum_hook)
    elif compression in ("fp16", "bf16"):
        model.register_comm_hook(None, _compressed_sum_hook(torch.float16 if compression == "fp16" else torch.bfloat16))
    else:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        if powersgd_start_iter < 2:  # torch's PowerSGD needs 2 plain steps to build its DDP buckets
            log.warning("powersgd_start_iter=%d raised to 2: PowerSGD starts after at least 2 plain all-reduce "
                        "steps.", powersgd_start_iter)
        state = PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                              start_powerSGD_iter=max(2, powersgd_start_iter))
        model.register_comm_hook(state, _powersgd_sum_hook(num_replicas))
    log.debug("gradient all-reduce: SUM, compression=%s", compression)
