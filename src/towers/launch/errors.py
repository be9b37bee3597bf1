"""``LaunchError``: what ``towers launch`` reports when the job cannot start or a worker failed."""

from __future__ import annotations

from towers.errors import TowersError

__all__ = ["LaunchError"]


class LaunchError(TowersError, RuntimeError):
    """The job could not start, or a worker failed; ``exit_code`` is what ``towers launch`` exits with."""

    def __init__(self, message: str, *, exit_code: int = 1, failed_rank: int | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.failed_rank = failed_rank
