"""``ThroughputMeter``: examples/s, tokens/s and model-FLOPs utilisation (MFU) of training steps.

The ``Trainer`` keeps one (``trainer.throughput``) and puts its numbers in every epoch's logs; a
custom loop wraps its steps in one::

    meter = towers.ThroughputMeter(strategy)
    for x, y in strategy.distribute_dataset(train_set, global_batch_size=64):
        with meter.step((x, y)):
            strategy.run(step, args=(x, y))
    print(meter.summary(synchronize=True))   # {"examples_per_second": ..., "mfu": ...}

The first step a meter sees runs under ``torch.utils.flop_counter.FlopCounterMode``: its forward
and backward give the model FLOPs per example (and per token for a token model). That step is
slower (every torch operation passes through Python once) and is left out of the timing when the
window has other steps. MFU = model FLOPs/s of all replicas / (one device's peak x the replicas):
the peak is a GPU's datasheet figure for the precision the strategy computes in, or the CPU's
measured float32 matmul peak (``towers.diagnostics.peak``).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Iterator, Protocol

import torch

from towers._logging import get_logger
from towers.data import find_batch_info
from towers.diagnostics.flops import BatchShape, batch_shape, counting_flops
from towers.diagnostics.peak import PeakFlops, device_peak
from towers.errors import InvalidArgumentError

__all__ = ["ThroughputMeter", "THROUGHPUT_KEYS"]

log = get_logger(__name__)

#: The keys ``summary()`` fills, and the Trainer's epoch logs with them (measured: they differ run to run).
THROUGHPUT_KEYS = ("examples_per_second", "tokens_per_second", "mfu")

_said_unknown: set[str] = set()  # devices whose missing peak was logged (once per process)


class StrategyLike(Protocol):
    """What the meter reads from a strategy: where one replica computes, how many take part, and in what precision."""

    @property
    def device(self) -> torch.device: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def precision(self) -> Any: ...


class ThroughputMeter:
    """Measure the examples/s, tokens/s and MFU of the training steps wrapped in ``step(batch)``.

    Args:
        strategy: the one the steps run under (its device, replica count and precision), or None for one CPU
            in float32.
        peak_flops: one device's peak FLOP/s, for a GPU that is not in
            ``towers.diagnostics.peak.GPU_PEAK_TFLOPS`` (or to compare against your own figure).

    Raises:
        ValueError: when ``peak_flops`` is not a positive number.
    """

    def __init__(self, strategy: StrategyLike | None = None, *, peak_flops: float | None = None):
        if peak_flops is not None and (isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float))
                                       or not math.isfinite(peak_flops) or peak_flops <= 0):
            raise InvalidArgumentError(f"peak_flops must be one device's peak in FLOP/s, a positive number (e.g. 989.5e12 for an "
                                       f"H100 SXM in bf16). Received: {peak_flops!r}.")
        self.device = torch.device(strategy.device) if strategy is not None else torch.device("cpu")
        self.num_devices = int(strategy.num_replicas_in_sync) if strategy is not None else 1
        self.precision = str(getattr(getattr(strategy, "precision", None), "name", "32"))
        self._peak_given = None if peak_flops is None else float(peak_flops)
        self._peak: PeakFlops | None = None
        self._peak_resolved = False
        #: Model FLOPs of one example's forward and backward (None until a step was counted, or when none were seen).
        self.flops_per_example: float | None = None
        #: The same per token, for a token model (None otherwise).
        self.flops_per_token: float | None = None
        self._flops_counted = False
        self.reset()

    def reset(self) -> None:
        """Start a new window (an epoch): the next step's start is its start."""
        self._start: float | None = None
        self._end: float | None = None
        self._examples = 0.0
        self._tokens: float | None = None
        self._steps = 0
        self._counted_step: tuple[float, float, float | None] | None = None  # (seconds, examples, tokens)

    @contextlib.contextmanager
    def step(self, batch: Any) -> Iterator[None]:
        """Time the training step in the block, on ``batch`` (this replica's share: what the step is given).

        The first step of a meter also counts its model FLOPs. A step that raises is not counted.
        """
        shape = batch_shape(batch)
        examples = self._global_examples(batch, shape)
        tokens = shape.tokens * examples / shape.rows if shape.tokens is not None and shape.rows else None
        start = time.perf_counter()
        if self._start is None:
            self._start = start
        if self._flops_counted or shape.rows == 0:
            yield
            self._add(time.perf_counter(), examples, tokens)
            return
        with counting_flops() as tally:
            yield
        self._flops_counted = True
        if tally.total > 0:
            self.flops_per_example = tally.total / shape.rows
            self.flops_per_token = tally.total / shape.tokens if shape.tokens else None
        _ = self.peak  # found now (a CPU's is measured), in this step's time, which the window leaves out
        self._end = time.perf_counter()
        self._counted_step = (self._end - start, examples, tokens)

    def _add(self, end: float, examples: float, tokens: float | None) -> None:
        self._end = end
        self._steps += 1
        self._examples += examples
        if tokens is not None:
            self._tokens = (self._tokens or 0.0) + tokens

    def _global_examples(self, batch: Any, shape: BatchShape) -> float:
        """The step's examples over all replicas: the batch's accounting, else its rows on every replica."""
        try:
            info = find_batch_info((batch,))
        except ValueError:
            info = None
        return float(info.global_batch_size if info is not None else shape.rows * self.num_devices)

    @property
    def peak(self) -> PeakFlops | None:
        """One device's peak FLOP/s and its source, or None when unknown (no MFU then; said once in the log)."""
        if not self._peak_resolved:
            self._peak_resolved = True
            if self._peak_given is not None:
                self._peak = PeakFlops(self._peak_given, f"given peak {self._peak_given / 1e12:g} TFLOP/s")
            else:
                self._peak = device_peak(self.device, self.precision)
            if self._peak is None:
                name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else str(self.device)
                if name not in _said_unknown:
                    _said_unknown.add(name)
                    log.warning("MFU is not shown: towers knows no peak FLOP/s for %s (precision %s). Pass "
                                "ThroughputMeter(strategy, peak_flops=...) with the datasheet's dense figure for one "
                                "device.", name, self.precision)
            else:
                log.info("MFU is relative to %s per device, %d device(s)", self._peak.label, self.num_devices)
        return self._peak

    def summary(self, *, synchronize: bool = False) -> dict[str, float]:
        """Return this window's ``examples_per_second``, ``tokens_per_second`` (token models) and ``mfu`` (0..1).

        Keys whose value is unknown are left out (``mfu`` without a peak or a FLOP count; all of them
        before a step ended). Time runs from the first step's start to the last one's end, on this
        process's clock, without the step that counted FLOPs when there are others. ``synchronize``:
        wait for the device's queued work and count the window up to now (on a GPU the host runs
        ahead of the device; call it right after the last step).
        """
        if synchronize and self._end is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._end = time.perf_counter()
        if self._start is None or self._end is None:
            return {}
        seconds, examples, tokens = self._end - self._start, self._examples, self._tokens
        if self._counted_step is not None:
            if self._steps == 0:  # the window's only step: its time, however slow, is all there is
                seconds, examples, tokens = self._counted_step
            else:
                seconds -= self._counted_step[0]
        if seconds <= 0 or examples <= 0:
            return {}
        logs = {"examples_per_second": examples / seconds}
        if tokens is not None:
            logs["tokens_per_second"] = tokens / seconds
        peak = self.peak
        if peak is not None and self.flops_per_example is not None:
            flops = self.flops_per_token * tokens if self.flops_per_token and tokens else self.flops_per_example * examples
            logs["mfu"] = flops / seconds / (peak.flops_per_second * self.num_devices)
        return logs
