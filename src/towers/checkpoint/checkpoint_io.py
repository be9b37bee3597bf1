"""``CheckpointIO``: who writes a checkpoint's tensors, and the asynchronous save still in flight.

``chief_error`` runs a step on the chief and raises its failure on every process, so that none
waits for the chief in a collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import time
from pathlib import Path
from typing import Any, Callable

from towers._logging import get_logger
from towers.checkpoint import integrity
from towers.checkpoint.state import CheckpointError

__all__ = ["CheckpointIO", "Pending", "chief_error"]

log = get_logger(__name__)


class Pending:
    """An asynchronous save in flight: published (on the chief) as soon as its write is done, from DCP's thread."""

    def __init__(self, future: Any, publish: Callable[[], None], path: Path, nbytes: int):
        import threading

        self.future, self.path, self.nbytes = future, path, nbytes
        self.started_s = time.perf_counter()
        self._published = threading.Event()
        self._error: BaseException | None = None

        def on_done(done: Any) -> None:
            try:
                done.result()
                publish()
            except BaseException as exc:  # reported by wait(), in the training thread
                self._error = exc
            finally:
                self._published.set()

        future.add_done_callback(on_done)

    def wait(self) -> None:
        """Block until the checkpoint is written and visible at its path; re-raise what went wrong."""
        self._published.wait()
        if self._error is not None and integrity.is_disk_full(self._error):
            raise integrity.disk_full_error(self.path, self.nbytes) from None
        if self._error is not None:
            raise OSError(f"Asynchronous checkpoint {self.path} failed: {type(self._error).__name__}: "
                          f"{self._error}. The previous checkpoint at that path is intact.") from self._error
        log.debug("async checkpoint %s visible %.2f s after it started", self.path,
                  time.perf_counter() - self.started_s)


@dataclasses.dataclass
class CheckpointIO:
    """How a strategy's processes write a checkpoint's tensors; the strategy owns one (``Strategy.checkpoint_io``).

    Args:
        collective: every process writes its part through DCP over ``process_group``, each replicated tensor
            once; False: the chief writes every tensor alone (parameter servers, where the state lives on ps
            tasks that do not run the script).
        process_group: the group of a collective write. None: the default group.
        async_save: the tensors are copied to memory and written by a background thread; the save returns at
            once, and ``wait`` (called by the next save and read) blocks until it is published.
        gather_parts: where processes hold different parts of the model (pipeline stages), every part's
            ``obj`` from the processes holding the others, the chief's first (None: each holds every key):
            the manifest then lists every part's tensors, and a restore reads only this process's.
        pending: the asynchronous save in flight, set by a save with ``async_save`` (None: none); ``wait``
            clears it.
    """

    collective: bool = True
    process_group: Any = None
    async_save: bool = False
    gather_parts: Callable[[Any], list[Any]] | None = None
    pending: Pending | None = None

    def wait(self, *, is_chief: bool, broadcast_object: Callable[[Any, int], Any]) -> None:
        """Block until an asynchronous save (if any) is written and published; every process calls it.

        Raises:
            OSError: on every process, when the save failed on the chief (the previous checkpoint is intact).
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if not is_chief:  # its own background write; a failure there fails the chief's too (DCP gathers them)
            with contextlib.suppress(Exception):
                pending.wait()
        chief_error(is_chief, broadcast_object, pending.wait)



def chief_error(is_chief: bool, broadcast_object: Callable[[Any, int], Any], action: Callable[[], Any]) -> Any:
    """Run ``action`` on the chief and return its value on every process; every process raises if it failed.

    (So that none waits for the chief in a collective.)
    """
    error, value = None, None
    if is_chief:
        try:
            value = action()
        except Exception as exc:  # reported to every process below
            error = (type(exc).__name__, str(exc), getattr(exc, "errno", None))
    error, value = broadcast_object((error, value), 0)
    if error is None:
        return value
    kind, text, code = error
    if kind == CheckpointError.__name__:
        raise CheckpointError(text)
    if code == errno.ENOSPC and text.startswith("No space left on device:"):
        no_space = OSError(text)
        no_space.errno = errno.ENOSPC
        raise no_space
    raise OSError(f"The chief could not write the checkpoint: {kind}: {text}. Check the directory (it must be "
                  "writable, with free space); the previous checkpoint at that path is intact.")
