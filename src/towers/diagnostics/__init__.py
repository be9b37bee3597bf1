"""Diagnostics for stuck jobs: a watchdog per process that names the stuck rank and ends the job.

``track(kind)`` marks a blocking towers call (a collective, a parameter-server request);
``start_watchdog(info)`` starts the process's watchdog once the process group exists (the process
group module does it); ``stop_watchdog()`` stops it. See ``watchdog.py`` for the protocol,
``report.py`` for the verdict and ``lifecycle.py`` for the one watchdog of a process.

``StepBreakdown`` (``step_breakdown.py``, with ``breakdown.py`` timing and ``straggler.py`` naming the
slow rank): where each rank's step time goes, for a custom loop; loaded on first use, as it needs
the strategies.

``gpu_report.py`` (imported by name, not from here) is the GPU tier's report: the machine, each
check and its figures, as JSON and Markdown (``make gpu-check``).
"""

from towers.diagnostics.lifecycle import current_watchdog, start_watchdog, stop_watchdog
from towers.diagnostics.progress import enable_flight_recorder, set_role, track
from towers.diagnostics.report import STUCK_EXIT_CODE, build_report
from towers.diagnostics.watchdog import DEFAULT_FACTOR, DEFAULT_MIN_S, Watchdog, python_stacks

__all__ = ["track", "set_role", "enable_flight_recorder", "start_watchdog", "stop_watchdog", "current_watchdog",
           "Watchdog", "STUCK_EXIT_CODE", "DEFAULT_MIN_S", "DEFAULT_FACTOR", "build_report", "python_stacks",
           "StepBreakdown", "ThroughputMeter"]


def __getattr__(name: str):
    # The strategies import this package (track), so the breakdown, which needs them, loads on first use.
    if name == "StepBreakdown":
        from towers.diagnostics.step_breakdown import StepBreakdown

        return StepBreakdown
    if name == "ThroughputMeter":  # examples/s, tokens/s and MFU (throughput.py, flops.py, peak.py)
        from towers.diagnostics.throughput import ThroughputMeter

        return ThroughputMeter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
