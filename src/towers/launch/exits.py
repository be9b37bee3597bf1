"""How a process ended, in words: shared by the launcher's report and the per-rank supervisor."""

from __future__ import annotations

import signal

__all__ = ["PREEMPTED_EXIT_CODE", "describe_exit"]

#: The exit code of a process that saved on a preemption notice: "temporary failure, start me again" (EX_TEMPFAIL).
#: ``towers launch --max-restarts``, the manifests of ``towers k8s`` and the SLURM script restart on it.
PREEMPTED_EXIT_CODE = 75


def describe_exit(returncode: int) -> str:
    """Return ``"exited with code N"`` or ``"was killed by SIGNAME"`` for a ``Popen``-style return code."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    if returncode == PREEMPTED_EXIT_CODE:
        return f"exited with code {returncode} (preempted: it saved a checkpoint and asks for a restart)"
    return f"exited with code {returncode}"
