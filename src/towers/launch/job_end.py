"""The record that a fault-tolerant job's training is over, for a replica group started again after its last step.

Under ``towers launch --strategy fault_tolerant`` the live replica groups step together, so they
end together: a group whose processes all exited 0 ran the script to its end, and the job's
training ended with it. Its supervisor (``towers.launch.replica_group``) records that
(``note_job_complete``): a note in the job's launch directory (``ProcessInfo.launch_dir``: one per
node, a file, no torch needed), and for a job across nodes also a key in torchrun's agent store,
which every node reaches (``MASTER_ADDR:MASTER_PORT``, under the restart attempt's keys).

A group started again after the job's last committed step has no live group to heal from and no
quorum to join. Its supervisor reads the note (``job_end_noted``) before it starts the group again,
and while the group has not joined a step (the strategy notes that it joined, ``JobEndView.joined``):
it stops the group and exits 0 with one line, instead of letting it wait ``quorum_timeout_s`` for
groups that are gone, fail and be started again. On another node than the groups that ended, the
group's own strategy reads the store before its first quorum and while it waits for one
(``JobEndView.ended``) and ends the script with ``JobComplete`` (exit code 0). Groups started by hand
have neither record, and wait as before.

The other record is the job's failure: a process that ends with an error every replica group shares (a
collective that not every group called, ``fault_tolerant.agreement``) notes it first (``JobEndView.failed``,
in the launch directory). Its supervisor then does not start the group again (a new start would find
the same job, and train on alone in silence): the group's exit is the job's, non-zero.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from towers._logging import get_logger
from towers.cluster.info import ProcessInfo

__all__ = ["JobEnd", "JobComplete", "JobEndView", "note_job_complete", "job_end_noted", "joined_noted",
           "job_failure_noted"]

log = get_logger(__name__)

_NOTE = "ft-job-complete"
_JOINED_NOTE = "ft-joined-pid"
_FAILED_NOTE = "ft-job-failed"
#: Seconds a store call may take before the record is taken as unreadable (the job goes on as without it).
_STORE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class JobEnd:
    """A replica group ended the job's training: which group, and when (``time.time()``)."""

    group: int
    time: float

    def describe(self) -> str:
        """``replica group G ended the job's training S s ago``."""
        return f"replica group {self.group} ended the job's training {max(0.0, time.time() - self.time):.1f} s ago"


class JobComplete(SystemExit):
    """Raised (exit code 0) in a replica group started again after the job's training ended: nothing is left to train.

    A ``SystemExit``: the script ends with exit code 0 through its ``finally`` blocks, and an
    ``except Exception`` in the training loop does not catch it.
    """

    def __init__(self, end: JobEnd) -> None:
        super().__init__(0)
        self.end = end


def _spans_nodes(info: ProcessInfo) -> bool:
    return info.world_size > info.local_world_size


def _store_key(info: ProcessInfo) -> str:
    return f"towers/attempt_{info.restart_count}/ft/job_complete"


def _store(info: ProcessInfo) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(info.master_addr, int(info.master_port or 0), is_master=False, wait_for_workers=False,
                    timeout=timedelta(seconds=_STORE_TIMEOUT_S))


def note_job_complete(info: ProcessInfo, group: int) -> None:
    """Record that replica group ``group`` ended the job's training (its processes all exited 0), for ``info``'s job.

    Raises:
        OSError: the launch directory cannot be written.
        RuntimeError: the job's store cannot be reached (a job across nodes).
    """
    value = json.dumps({"group": int(group), "time": time.time()})
    if info.launch_dir:
        path = os.path.join(info.launch_dir, _NOTE)
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            fh.write(value)
        os.replace(path + ".tmp", path)
    if _spans_nodes(info) and info.agent_store and info.master_port is not None:  # groups on the other nodes
        _store(info).set(_store_key(info), value)


def _parse(text: str | bytes) -> JobEnd | None:
    try:
        value = json.loads(text)
        return JobEnd(group=int(value["group"]), time=float(value["time"]))
    except (ValueError, KeyError, TypeError):
        return None


def job_end_noted(launch_dir: str | None) -> JobEnd | None:
    """Return the job's end noted in ``launch_dir`` (this node's), or None."""
    if not launch_dir:
        return None
    try:
        with open(os.path.join(launch_dir, _NOTE), encoding="utf-8") as fh:
            return _parse(fh.read())
    except OSError:
        return None


def joined_noted(launch_dir: str | None, pid: int) -> bool:
    """True when process ``pid`` noted in ``launch_dir`` that it took part in a step of the job (``JobEndView.joined``)."""
    return bool(launch_dir) and os.path.exists(os.path.join(str(launch_dir), f"{_JOINED_NOTE}{pid}"))


def job_failure_noted(launch_dir: str | None, attempt: int = 0) -> str | None:
    """Return the error a process of this node noted as the failure of the job's ``attempt`` (torchrun's restart
    count: a job restarted whole starts afresh) (``JobEndView.failed``), or None."""
    if not launch_dir:
        return None
    try:
        with open(os.path.join(launch_dir, f"{_FAILED_NOTE}-{attempt}"), encoding="utf-8") as fh:
            return fh.read() or None
    except OSError:
        return None


class JobEndView:
    """A replica group's side of the record: it notes that it joined the job, and reads the job's end across nodes."""

    def __init__(self, info: ProcessInfo) -> None:
        self._launch_dir, self._attempt = info.launch_dir, info.restart_count
        self._info = info if _spans_nodes(info) and info.agent_store and info.master_port is not None else None
        self._store: Any = None
        self._noted = False

    def joined(self) -> None:
        """Note (once) that this process took part in a step of the job: its supervisor no longer stops it at the end."""
        if self._noted or not self._launch_dir:
            return
        self._noted = True
        try:
            with open(os.path.join(self._launch_dir, f"{_JOINED_NOTE}{os.getpid()}"), "w", encoding="utf-8"):
                pass
        except OSError as exc:
            log.debug("could not note in %s that this group joined the job: %s", self._launch_dir, exc)

    def failed(self, error: str) -> None:
        """Note that this process ends the job with ``error``, shared by every group: its supervisor does not restart it."""
        if not self._launch_dir:
            return
        path = os.path.join(self._launch_dir, f"{_FAILED_NOTE}-{self._attempt}")
        try:
            with open(f"{path}.{os.getpid()}", "w", encoding="utf-8") as fh:
                fh.write(error.splitlines()[0] if error else "failed")
            os.replace(f"{path}.{os.getpid()}", path)
        except OSError as exc:
            log.warning("could not note in %s that the job failed (%s): this group may be started again", self._launch_dir,
                        exc)

    def noted(self) -> JobEnd | None:
        """The job's end, noted on this node or (across nodes) in the job's store; else None."""
        return job_end_noted(self._launch_dir) or self.ended()

    def ended(self) -> JobEnd | None:
        """The job's end, when a group on another node recorded it in the job's store; else None."""
        if self._info is None:
            return None
        try:
            if self._store is None:
                self._store = _store(self._info)
            key = _store_key(self._info)
            return _parse(self._store.get(key)) if self._store.check([key]) else None
        except Exception as exc:  # torch's store errors are RuntimeErrors (DistStoreError, ...)
            log.debug("the job's end could not be read from its store (%s: %s)", type(exc).__name__, exc)
            if self._store is None:
                self._info = None  # unreachable: not asked again (each try waits for the timeout)
            return None
