"""Diagnostics for stuck jobs: a watchdog per process that names the stuck rank and ends the job.

``track(kind)`` marks a blocking towers call (a collective, a parameter-server request);
``start_watchdog(info)`` starts the process's watchdog once the process group exists (the process
group module does it); ``stop_watchdog()`` stops it. See ``watchdog.py`` for the protocol,
``report.py`` for the verdict and ``lifecycle.py`` for the one watchdog of a process.

``gpu_report.py`` (imported by name, not from here) is the GPU tier's report: the machine, each
check and its figures, as JSON and Markdown (``make gpu-check``).
"""

from towers.diagnostics.lifecycle import current_watchdog, start_watchdog, stop_watchdog
from towers.diagnostics.progress import enable_flight_recorder, set_role, track
from towers.diagnostics.report import STUCK_EXIT_CODE, build_report
from towers.diagnostics.watchdog import DEFAULT_FACTOR, DEFAULT_MIN_S, Watchdog, python_stacks

__all__ = ["track", "set_role", "enable_flight_recorder", "start_watchdog", "stop_watchdog", "current_watchdog",
           "Watchdog", "STUCK_EXIT_CODE", "DEFAULT_MIN_S", "DEFAULT_FACTOR", "build_report", "python_stacks"]
