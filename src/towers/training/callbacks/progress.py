"""``ProgressBar``: a tqdm bar per epoch (chief only) with the running metrics, examples/s, tokens/s and MFU."""

from __future__ import annotations

import sys
import time
from typing import Any, Mapping, TextIO

from towers.errors import InvalidArgumentError
from towers.training.callbacks.base import Callback

__all__ = ["ProgressBar"]

_MODES = ("auto", "bar", "epoch", "off")


_THROUGHPUT_KEYS = ("examples_per_second", "tokens_per_second", "mfu")


def _format_logs(logs: Mapping[str, Any], skip: tuple[str, ...] = ()) -> str:
    # The step breakdown's time/<phase> keys are left out: they have a line of their own at each report (and the
    # History and the trackers keep them), so an epoch's line stays what a Keras user reads: loss, metrics, speed.
    return ", ".join(f"{k} {v:.4g}" for k, v in logs.items()
                     if k not in skip and k not in _THROUGHPUT_KEYS and not k.startswith("time/")
                     and isinstance(v, (int, float)))


def _format_throughput(examples_per_second: float, logs: Mapping[str, Any], peak: Any = None) -> str:
    """``"1,234 examples/s, 56,789 tokens/s, MFU 41.2%"``; a measured peak (the CPU's) is said to be one."""
    text = f"{examples_per_second:,.0f} examples/s"
    if isinstance(logs.get("tokens_per_second"), (int, float)):
        text += f", {logs['tokens_per_second']:,.0f} tokens/s"
    if isinstance(logs.get("mfu"), (int, float)):
        text += f", MFU {logs['mfu']:.1%}" + (" of the measured CPU peak" if getattr(peak, "measured", False) else "")
    return text


class ProgressBar(Callback):
    """Show training progress on the chief: the running loss/metrics, examples and tokens per second, and MFU.

    Args:
        mode: ``"bar"`` draws a tqdm bar per epoch; ``"epoch"`` writes one line per epoch (what a log file
            wants); ``"auto"`` draws bars when ``stream`` is a terminal and lines otherwise; ``"off"`` shows
            nothing.
        stream: where to write. Default: ``sys.stderr``.

    Raises:
        ValueError: an unknown ``mode``.
    """

    _PER_BATCH_KEYS = ("size", "examples", "nonfinite_replicas", "global_step")

    def __init__(self, *, mode: str = "auto", stream: TextIO | None = None):
        super().__init__()
        if mode not in _MODES:
            raise InvalidArgumentError(f"mode must be one of {_MODES}. Received: {mode!r}.")
        self.mode = mode
        self.stream = stream
        self._bar: Any = None
        self._start = self._last = 0.0
        self._examples = 0
        self._active = False
        self._resolved = mode

    def _out(self) -> TextIO:
        return self.stream or sys.stderr

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        mode = self.mode
        if mode == "auto":
            isatty = getattr(self._out(), "isatty", None)
            mode = "bar" if isatty is not None and isatty() else "epoch"
        self._resolved = mode
        self._active = mode != "off" and self.attached and self.trainer.strategy.is_chief

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if not self._active:
            return
        self._start = self._last = time.perf_counter()
        self._examples = 0
        if self._resolved == "bar":
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.params.get("steps"), desc=f"epoch {epoch + 1}/{self.params.get('epochs', '?')}",
                             unit="step", file=self._out(), leave=True, dynamic_ncols=True)

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        if not self._active:
            return
        logs = logs or {}
        self._last = time.perf_counter()
        self._examples += int(logs.get("size", 0))
        if self._bar is not None:
            meter = getattr(self.trainer, "throughput", None)  # the Trainer's: tokens/s and MFU so far
            rates = _format_throughput(self.examples_per_second, meter.summary() if meter is not None else {})
            self._bar.set_postfix_str(f"{_format_logs(logs, self._PER_BATCH_KEYS)}, {rates}", refresh=False)
            self._bar.update(1)

    @property
    def examples_per_second(self) -> float:
        """Global training examples per second in the current epoch (validation excluded)."""
        elapsed = self._last - self._start
        return self._examples / elapsed if elapsed > 0 else 0.0

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if not self._active:
            return
        logs = logs or {}
        meter = getattr(self.trainer, "throughput", None)
        shown = logs.get("examples_per_second", self.examples_per_second)  # the Trainer's: the epoch's training steps
        text = f"{_format_logs(logs, ('lr',))}, {_format_throughput(shown, logs, getattr(meter, 'peak', None))}"
        if self._bar is not None:
            self._bar.set_postfix_str(text)
            self._bar.close()
            self._bar = None
        else:
            out = self._out()
            out.write(f"epoch {epoch + 1}/{self.params.get('epochs', '?')}: {text}, "
                      f"{time.perf_counter() - self._start:.1f} s\n")
            out.flush()

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
