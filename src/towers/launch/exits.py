"""How a process ended, in words: shared by the launcher's report and the per-rank supervisor."""

from __future__ import annotations

import signal

__all__ = ["describe_exit"]


def describe_exit(returncode: int) -> str:
    """Return ``"exited with code N"`` or ``"was killed by SIGNAME"`` for a ``Popen``-style return code."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"
