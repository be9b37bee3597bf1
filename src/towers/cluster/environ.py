"""The one place in towers that touches ``os.environ``: a snapshot to read, a scoped override to write,
and the network interface the job binds (``export_interface``).

Everything else receives a mapping (or a ``ProcessInfo``), so tests pass plain dicts.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

__all__ = ["read_environ", "environ_overrides", "export_interface"]


def read_environ() -> dict[str, str]:
    """Return a copy of this process's environment variables.

    Returns:
        ``dict(os.environ)``: what ``from_env`` and the cluster environments read, as a plain dict.
    """
    return dict(os.environ)


@contextlib.contextmanager
def environ_overrides(updates: Mapping[str, str]) -> Iterator[None]:
    """Set ``updates`` in ``os.environ`` (inherited by child processes) and restore the old values on exit.

    Args:
        updates: variable -> value (values are made strings).

    Yields:
        Nothing; the variables are set inside the ``with`` block.
    """
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update({key: str(value) for key, value in updates.items()})
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def export_interface(name: str, *, collectives_only: bool = False) -> None:
    """Make this process's Gloo and NCCL groups bind interface ``name``, for the rest of its life.

    Sets ``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME`` and (unless ``collectives_only``)
    ``TOWERS_INTERFACE`` where they are unset (a value the user set wins); torch reads them whenever
    it creates a process group.
    """
    keys = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") + (() if collectives_only else ("TOWERS_INTERFACE",))
    for key in keys:
        if not os.environ.get(key, "").strip():
            os.environ[key] = name
