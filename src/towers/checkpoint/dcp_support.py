"""``torch.distributed.checkpoint`` as towers uses it: its single-process warning silenced, its failures in one line."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from towers.checkpoint.state import CorruptCheckpointError

__all__ = ["quiet_single_process", "failures", "corruption", "one_line", "root_cause"]


@contextlib.contextmanager
def quiet_single_process() -> Any:
    """Silence DCP's warning that a single-process save or load "assumes" one process."""
    # DCP warns on every single-process save/load that it "assumes" one process; here that is the point.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def failures(exc: BaseException) -> list[BaseException]:
    """The exceptions of each process inside DCP's ``CheckpointException`` (``(exception, traceback)`` pairs), or ``[exc]``."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException) and exc.failures:
        return [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
    return [exc]


def corruption(exc: BaseException) -> str | None:
    """The message of a ``CorruptCheckpointError`` raised by any process inside DCP, or None."""
    found = [f for f in failures(exc) if isinstance(f, CorruptCheckpointError)]
    return str(found[0]) if found else None


def one_line(exc: BaseException) -> str:
    """Return ``exc`` as one line: its type and the last line of its message."""
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    fallback = "the data ends early" if isinstance(exc, EOFError) else "(no message)"
    return f"{type(exc).__name__}: {text[-1].strip() if text else fallback}"


def root_cause(exc: BaseException) -> str:
    """Return the first (at most two) processes' failures inside ``exc``, one line each, joined by ``; ``."""
    return "; ".join(one_line(f) for f in failures(exc)[:2])
