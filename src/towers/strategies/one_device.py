"""OneDeviceStrategy: one replica on one device — the reference every other strategy must match."""

from __future__ import annotations

from typing import Any

import torch

from towers._logging import get_logger
from towers.cluster.info import ProcessInfo
from towers.cluster.strategy_options import parse_flag
from towers.strategies._bitwise_setup import bitwise_steps
from towers.strategies._collectives import LocalComm
from towers.strategies._comm_hooks import check_compression
from towers.strategies._sync import SyncStrategy

__all__ = ["OneDeviceStrategy"]

log = get_logger(__name__)


def _default_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


class OneDeviceStrategy(SyncStrategy):
    """Everything on one device: ``distribute_dataset`` yields whole global batches; collectives are identities.

    The reference every other strategy is measured against: N replicas of ``MirroredStrategy`` give the
    same updates as this strategy on the global batch.

    Args:
        device: the device, e.g. ``"cpu"``, ``"cuda:1"`` or ``"/gpu:1"``. Default: the first GPU, else the CPU.
        info: this process's place in the job. Default: read from the environment.
        timeout_s: accepted for the signature every strategy shares; nothing here waits on a peer.
        precision: ``"32"``, ``"bf16"`` or ``"fp16"``, as under ``MirroredStrategy``.
        gradient_accumulation_steps: micro-batches per optimizer update, as under ``MirroredStrategy``.
        sync_batchnorm: accepted and has nothing to do on one device (so one script can pass it to any
            strategy); the same for ``gradient_compression``, ``bucket_cap_mb`` and ``find_unused_parameters``.
        gradient_compression: accepted; nothing to compress on one device.
        bucket_cap_mb: accepted; no buckets on one device.
        find_unused_parameters: accepted; no DDP on one device.
        bitwise: the same bits as one process at any replica count (``micro_batch_size``: given, or B / 12).
        micro_batch_size: the examples of one micro-batch under ``bitwise=True``.

    Example:
        ```python
        import torch
        import towers

        strategy = towers.OneDeviceStrategy("cpu")
        with strategy.scope():
            model = torch.nn.Linear(16, 4)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = strategy.prepare(model, optimizer)
        data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))

        def loss_fn(logits, y):
            return towers.compute_average_loss(torch.nn.functional.cross_entropy(logits, y, reduction="none"))

        def step(x, y):
            loss, _ = strategy.forward_backward(model, x, y, loss_fn)
            optimizer.step()
            optimizer.zero_grad()
            return loss

        for x, y in strategy.distribute_dataset(data, global_batch_size=16):
            loss = strategy.reduce("sum", strategy.run(step, args=(x, y)))
        ```
    """

    name = "one_device"

    def __init__(self, device: Any = None, *, info: ProcessInfo | None = None, timeout_s: float | None = None,
                 precision: str | int | None = "32", gradient_accumulation_steps: int = 1,
                 sync_batchnorm: bool = False, gradient_compression: str | None = None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False, bitwise: bool = False,
                 micro_batch_size: int | None = None):
        from towers import cluster
        from towers.devices import resolve_device, warn_if_gpus_idle
        from towers.strategies.precision import resolve_precision

        check_compression(gradient_compression)
        parse_flag("sync_batchnorm", sync_batchnorm)  # checked as under Mirrored: a typo fails on one device too
        parse_flag("find_unused_parameters", find_unused_parameters)
        info = info or cluster.from_env()
        resolved = resolve_device(_default_device() if device is None else device)
        warn_if_gpus_idle(info.local_world_size, [resolved], local_rank=info.local_rank)
        build = bitwise_steps(bitwise, micro_batch_size, strategy=type(self).__name__,
                              precision=resolve_precision(precision, resolved).name)
        super().__init__(info=info, device=resolved, comm=LocalComm(), precision=precision,
                         gradient_accumulation_steps=gradient_accumulation_steps,
                         bitwise=None if build is None else build(0, 1, lambda t: t))
        log.debug("OneDeviceStrategy on %s (precision=%s, accumulation=%d)", resolved, self.precision.name,
                  gradient_accumulation_steps)
