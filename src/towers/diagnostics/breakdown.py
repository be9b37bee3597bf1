"""Where a step's time goes, per rank, without adding a synchronisation to the step.

``StepTimer`` splits the steps it is armed for into phases (``PHASES``: input, forward,
backward, comm_wait, cpu_wait, optimizer, other) from hooks: the model's forward pre/post hooks,
the optimizer's step pre/post hooks, and the caller's input and step-end marks. Phases follow each
other without gaps, so they add up to the step.

On the CPU a mark reads three clocks: ``time.perf_counter`` (wall), ``time.thread_time`` (this
thread's CPU time) and, on Linux, the time this thread spent runnable but waiting for a core
(``/proc/thread-self/schedstat``'s run-queue delay). CPU autograd runs backward on the calling
thread, and Gloo communicates on its own threads, so a compute phase's wall time minus its thread
CPU time is time the thread waited. The part spent waiting for a core (another process, or too
many threads for the cores) is ``cpu_wait``; the rest, asleep until something arrived, is
``comm_wait`` in a job that communicates (the gradient all-reduce, DDP's wait at the end of
backward, a parameter server's answer, an FSDP all-gather) and ``other`` in one that does not
(one replica: nothing to wait for but the machine). Where Linux does not say how long the thread
waited for a core, a job that communicates counts every wait as ``comm_wait`` and one that does
not as ``cpu_wait``. The compute phases keep their CPU time. (With several intra-op threads the
calling thread spins at OpenMP barriers, which counts as its CPU time: compute, as it should be.)

On a GPU a mark records a CUDA event on the current stream; events are read only by ``take()``
(at a report), never mid-step. Durations are the stream's. ``comm_wait`` there is the time from
the end of backward's kernels to the optimizer's step (in a job that communicates): a callback
queued as backward starts runs before DDP's and FSDP's end-of-backward callbacks (queued later,
at their first gradient bucket), records an event after the last backward kernel, and what the
stream does after it, up to the optimizer, is waiting for the gradient all-reduce those callbacks
make it wait for. Waits inside forward or the optimizer (FSDP's all-gathers) are not separated on
a GPU, and ``cpu_wait`` is 0 there.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["PHASES", "WINDOW_STEPS", "StepTimer", "measured_step", "timed_batches"]

PHASES = ("input", "forward", "backward", "comm_wait", "cpu_wait", "optimizer", "other")
_INDEX = {name: i for i, name in enumerate(PHASES)}
_COMPUTE = ("forward", "backward", "optimizer")  # phases whose thread waits are cpu_wait or comm_wait (CPU)
_SCHEDSTAT = "/proc/thread-self/schedstat"  # Linux: "<ns on a CPU> <ns waiting on a run queue> <time slices>"
#: Steps measured before each report (the last ones of its period): enough to average, cheap to keep.
WINDOW_STEPS = 10


def measured_step(step: int, every: int) -> bool:
    """True when 1-based ``step`` is one of the ``WINDOW_STEPS`` steps before a report (every ``every`` steps).

    The report's own step is left out (its collective is not a step's time), unless every step reports.
    """
    return every == 1 or 0 < (-step) % every <= WINDOW_STEPS


class StepTimer:
    """Per-phase time of the steps this rank is armed for; ``take()`` returns the sums and starts again."""

    def __init__(self, device: torch.device | str = "cpu", *, on_update: Callable[[], None] | None = None,
                 communicates: bool = True) -> None:
        self.cuda = torch.device(device).type == "cuda"
        #: The job has peers to wait for (replicas, parameter servers, pipeline stages): a thread's sleep in a compute
        #: phase is comm_wait. False (one replica): it is other, and nothing is ever comm_wait.
        self.communicates = communicates
        #: Called after each optimizer update, which then ends the step (a custom loop); None: the caller's
        #: ``end_step()`` does (the Trainer's batch end).
        self.on_update = on_update
        self.armed = False
        self._open: tuple[str, float, float, float | None, Any] | None = None  # phase, wall, CPU, queued, CUDA event
        self._schedstat: dict[int, int] = {}  # thread id -> its schedstat file, kept open (a read is a few µs)
        self._sums = [0.0] * len(PHASES)
        self._steps = 0
        self._began = False  # a step began since the last end_step (the mark that counts it)
        self._intervals: list[tuple[str, Any, Any]] = []  # CUDA: (phase, start event, end event), read at take()
        self._optimizer_depth = 0  # a wrapper's step calls its inner optimizer's: one phase
        self._handles: list[RemovableHandle] = []

    # --- hooks ------------------------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: Any = None) -> None:
        """Hook ``model``'s forward and ``optimizer``'s step (and those of the optimizers it wraps)."""
        self._handles.append(model.register_forward_pre_hook(self._forward_pre))
        self._handles.append(model.register_forward_hook(self._forward_post))
        seen: set[int] = set()
        while isinstance(optimizer, torch.optim.Optimizer) and id(optimizer) not in seen:
            seen.add(id(optimizer))
            try:  # a wrapper that never ran Optimizer.__init__ has no hooks; the optimizer it wraps steps
                self._handles.append(optimizer.register_step_pre_hook(self._optimizer_pre))
                self._handles.append(optimizer.register_step_post_hook(self._optimizer_post))
            except AttributeError:
                pass
            optimizer = getattr(optimizer, "optimizer", None)  # towers' prepared optimizers wrap the user's

    def detach(self) -> None:
        """Remove every hook ``attach`` added."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for fd in self._schedstat.values():
            if fd >= 0:
                os.close(fd)
        self._schedstat.clear()

    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        if self.armed and torch.is_grad_enabled():  # an evaluation pass inside a step is not its forward
            self._mark("forward")

    def _forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not (self.armed and torch.is_grad_enabled()):
            return
        self._mark("backward")
        if self.cuda and self.communicates:
            tensor = _first_grad_tensor(output)
            if tensor is not None:
                tensor.register_hook(self._at_backward_start)

    def _at_backward_start(self, grad: torch.Tensor) -> torch.Tensor:
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
        engine.queue_callback(lambda: self._mark("comm_wait"))  # before the strategies' end-of-backward waits
        return grad

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer_depth += 1
        if self._optimizer_depth == 1 and self.armed:
            self._mark("optimizer")

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._optimizer_depth = max(0, self._optimizer_depth - 1)
        if self._optimizer_depth:
            return
        if self.on_update is None:
            if self.armed:
                self._mark("other")
            return
        self.end_step()
        self.on_update()

    # --- marks from the loop ----------------------------------------------------------------------
    def input_begin(self) -> None:
        """The loop starts waiting for its next batch."""
        if self.armed:
            self._mark("input")

    def input_end(self) -> None:
        """The batch arrived."""
        if self.armed:
            self._mark("other")

    def end_step(self) -> None:
        """A step ended: close its last phase and count it (when a phase of it was measured)."""
        if self.armed and self._open is not None:
            self._mark("other")
            if self._began:
                self._steps += 1
            self._began = False

    def arm(self, on: bool) -> None:
        """Measure the steps from here (``on``) or stop measuring (the open phase is dropped)."""
        if not on:
            self.discard()
        self.armed = on

    def discard(self) -> None:
        """Drop the phase in progress (e.g. a validation pass between epochs is no step's time)."""
        self._open = None
        self._began = False

    def _queued(self) -> float | None:
        """Seconds this thread has waited for a core (runnable, not running) since it started; None: not known here."""
        thread = threading.get_native_id()
        fd = self._schedstat.get(thread)
        if fd is None:
            try:
                fd = os.open(_SCHEDSTAT, os.O_RDONLY)
            except OSError:
                fd = -1  # not Linux, or no scheduler statistics: asked once per thread
            self._schedstat[thread] = fd
        if fd < 0:
            return None
        try:
            return int(os.pread(fd, 128, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return None

    def _mark(self, phase: str) -> None:
        """Close the open phase at now and open ``phase``."""
        wall, cpu = time.perf_counter(), time.thread_time()
        queued = None if self.cuda else self._queued()
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        if self._open is not None:
            self._close(self._open, wall, cpu, queued, event)
        self._open = (phase, wall, cpu, queued, event)
        self._began = self._began or phase != "other"

    def _close(self, open_: tuple[str, float, float, float | None, Any], wall: float, cpu: float,
               queued: float | None, event: Any) -> None:
        phase, wall0, cpu0, queued0, event0 = open_
        if self.cuda:
            self._intervals.append((phase, event0, event))
            return
        elapsed = max(0.0, wall - wall0)
        if phase not in _COMPUTE:
            self._sums[_INDEX[phase]] += elapsed
            return
        computing = min(elapsed, max(0.0, cpu - cpu0))
        waited = elapsed - computing
        if queued is not None and queued0 is not None:
            for_a_core = min(waited, max(0.0, queued - queued0))
        else:  # not measured: one replica has nothing else to wait for; a job with peers waits for them
            for_a_core = 0.0 if self.communicates else waited
        self._sums[_INDEX[phase]] += computing
        self._sums[_INDEX["cpu_wait"]] += for_a_core
        self._sums[_INDEX["comm_wait" if self.communicates else "other"]] += waited - for_a_core

    # --- reading ----------------------------------------------------------------------------------
    def take(self) -> tuple[int, list[float]]:
        """Return ``(steps, seconds per phase summed over them)`` since the last call, and start again.

        On a GPU this is where the events are read (waiting for the last one, at most the step in flight).
        """
        if self.cuda and self._intervals:
            self._intervals[-1][2].synchronize()
            for phase, start, end in self._intervals:
                self._sums[_INDEX[phase]] += start.elapsed_time(end) / 1000.0
            self._intervals.clear()
        steps, sums = self._steps, self._sums
        self._steps, self._sums = 0, [0.0] * len(PHASES)
        return steps, sums


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor in a model's output that backward will reach (a tensor, tuple, dict, ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values: Iterator[Any] = iter(output.values()) if hasattr(output, "values") and callable(output.values) else (
        iter(output) if isinstance(output, (tuple, list)) else iter(()))
    for value in values:
        found = _first_grad_tensor(value)
        if found is not None:
            return found
    return None


def timed_batches(batches: Any, timer: StepTimer) -> Iterator[Any]:
    """Yield ``batches`` with the time each ``next()`` took measured as input (used by ``StepBreakdown.timed``)."""
    it = iter(batches)
    while True:
        timer.input_begin()
        try:
            batch = next(it)
        except StopIteration:
            timer.discard()
            return
        timer.input_end()
        yield batch
