"""The ``ClusterEnvironment`` interface, its error type, and parsing helpers shared by every source."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping

from towers.cluster import roles
from towers.cluster.info import DEFAULT_JOIN_TIMEOUT_S, ProcessInfo, TaskInfo
from towers.errors import TowersError

__all__ = ["ClusterConfigError", "ClusterEnvironment", "env_int", "launch_options", "role_of_rank",
           "JOIN_TIMEOUT_VARIABLE", "read_join_timeout", "STUCK_TIMEOUT_VARIABLE", "read_stuck_timeout"]

#: The variable that sets how long processes wait for each other at start-up (``towers launch --join-timeout``).
JOIN_TIMEOUT_VARIABLE = "TOWERS_JOIN_TIMEOUT_S"
#: The variable that sets the least time one collective may wait before the stuck-job watchdog ends the job.
STUCK_TIMEOUT_VARIABLE = "TOWERS_STUCK_TIMEOUT_S"


class ClusterConfigError(TowersError, ValueError):
    """The environment describes the cluster wrongly; the message names the variable and the fix."""


class ClusterEnvironment(ABC):
    """One source of "who am I" (TF_CONFIG, torchrun, SLURM, ...), read from a plain mapping.

    Subclasses never touch ``os.environ``: ``towers.cluster.from_env`` passes the mapping in, so a
    test builds a ``ProcessInfo`` from a dict.
    """

    #: Short name stored in ``ProcessInfo.source``.
    name: str = ""

    @abstractmethod
    def detect(self, environ: Mapping[str, str]) -> bool:
        """Return True when ``environ`` carries this source's variables."""

    @abstractmethod
    def process_info(self, environ: Mapping[str, str]) -> ProcessInfo:
        """Return this process's description from ``environ``.

        Raises:
            ClusterConfigError: when a variable is malformed or the values contradict each other.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def env_int(environ: Mapping[str, str], name: str, default: int | None = None, *, minimum: int = 0) -> int:
    """Return ``environ[name]`` as an int >= ``minimum`` (``default`` when unset).

    Raises:
        ClusterConfigError: when the value is not an integer, is too small, or is missing without a default.
    """
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ClusterConfigError(f"{name} is not set. Expected an integer >= {minimum}. Set {name} or unset the "
                                     "variables that made this source apply.")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ClusterConfigError(
            f"{name} must be an integer >= {minimum}. Received: {name}={raw!r}. "
            f"Set {name} to a whole number (e.g. {name}={max(minimum, 0)}).") from None
    if value < minimum:
        raise ClusterConfigError(
            f"{name} must be an integer >= {minimum}. Received: {name}={raw!r}. Fix the value that sets {name}.")
    return value


def read_join_timeout(environ: Mapping[str, str], default: float = DEFAULT_JOIN_TIMEOUT_S) -> float:
    """Return ``TOWERS_JOIN_TIMEOUT_S`` in seconds (``default`` when unset).

    Args:
        environ: the environment variables to read.
        default: the timeout when the variable is unset, in seconds.

    Returns:
        The timeout in seconds.

    Raises:
        ClusterConfigError: when the value is not a number > 0.
    """
    raw = environ.get(JOIN_TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ClusterConfigError(
            f"{JOIN_TIMEOUT_VARIABLE} must be a number of seconds > 0. Received: {JOIN_TIMEOUT_VARIABLE}={raw!r}. "
            f"Example: {JOIN_TIMEOUT_VARIABLE}=600, or unset it for the default ({default:g} s).")
    return value


def read_stuck_timeout(environ: Mapping[str, str]) -> float | None:
    """Return ``TOWERS_STUCK_TIMEOUT_S`` in seconds (None when unset; 0 turns the stuck-job watchdog off).

    Raises:
        ClusterConfigError: when the value is not a number >= 0.
    """
    raw = environ.get(STUCK_TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise ClusterConfigError(
            f"{STUCK_TIMEOUT_VARIABLE} must be a number of seconds >= 0. Received: {STUCK_TIMEOUT_VARIABLE}={raw!r}. "
            f"Example: {STUCK_TIMEOUT_VARIABLE}=120 (0 turns the stuck-job watchdog off).")
    return value


def launch_options(environ: Mapping[str, str], *, default_strategy: str | None = None,
                   default_num_ps: int = 0) -> tuple[str | None, int]:
    """Return ``(strategy, num_ps)`` from ``TOWERS_STRATEGY``/``TOWERS_NUM_PS`` (set by ``towers launch``).

    The strategy name is normalised the way the strategy registry does it (lower case, ``-`` -> ``_``).
    """
    raw = environ.get("TOWERS_STRATEGY", "").strip()
    strategy = raw.lower().replace("-", "_") if raw else default_strategy
    num_ps = env_int(environ, "TOWERS_NUM_PS", default_num_ps)
    return strategy, num_ps


def role_of_rank(rank: int, world_size: int, num_ps: int, *, variable: str = "TOWERS_NUM_PS") -> TaskInfo:
    """Return the task of ``rank`` when the last ``num_ps`` ranks are parameter servers (TF_CONFIG's order).

    Ranks ``0 .. world_size-num_ps-1`` are workers (``worker:<rank>``, worker 0 is the chief); the last
    ``num_ps`` ranks are ``ps:0 .. ps:num_ps-1``.

    Raises:
        ClusterConfigError: when ``num_ps`` leaves no worker.
    """
    try:
        roles.check_num_ps(num_ps, world_size, source=variable)
    except ValueError as exc:
        raise ClusterConfigError(str(exc)) from None
    task_type, index = roles.process_role(rank, world_size, num_ps)
    return TaskInfo(type=task_type, index=index)
