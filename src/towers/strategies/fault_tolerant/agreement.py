"""A collective every replica must call (``Metric.result()``), across the replica groups of a FaultTolerantStrategy.

Each replica group has its own process group, and no watchdog reaches across groups: the rescue of the
other strategies (``towers.diagnostics.named``) cannot find a group that went on without the call. Left
alone, the caller's all-reduce over the live groups times out after ``peer_timeout_s``, its group is
restarted, and the others train on: a job that ends 0 with the error hidden. Under ``towers launch``
(torchrun's agent store, which every group reaches), instead:

* every process that enters the call publishes it (``waiting``: group, rank, step, operation, fix) and
  counts itself in ``<step>/<k>/<tag>`` (the k-th named call since committed step ``step``: the same on
  every live group, one healed from a peer included), before any collective; the last of the live
  groups' processes to come deletes ``waiting`` and writes ``ok``;
* a process that begins its next step (``check``: one store write, ``began``, and one read per step) or
  whose collective over the groups failed, while a call it never made waits, writes the verdict
  (``named.describe``'s, as the other strategies say it);
* the caller reads ``began`` while it waits: a process that went on before the call was published waits
  in its next quorum, which the lighthouse does not form while the caller's group is alive. The caller
  writes the verdict and leaves (``leave``: its group stops its heartbeats), so that the quorum forms and
  that process finds the verdict at its next step; it does the same when a group's script ended
  (``towers.launch.job_end``'s record) while it waited;
* a group started again while a call waits (``lost``: one of its live groups died) tells the callers, which
  raise ``PeerLostError`` as a collective over the groups does when a group is lost;
* every process that takes the verdict notes the job's failure (``JobEndView.failed``: its supervisor does
  not start the group again, the job exits non-zero), waits until the processes missing from the call
  took it too (``named.ACK_S`` at most, plus two ``peer_timeout_s`` after the caller left), and raises
  ``PartialCollectiveError``.

Groups started by hand (no agent store) agree nothing: their collectives behave as before.
"""

from __future__ import annotations

import json
import time
from collections import deque
from datetime import timedelta
from typing import Any, Callable, NoReturn

from towers._logging import get_logger
from towers.cluster.info import ProcessInfo
from towers.diagnostics.named import ACK_S, NamedCall, describe
from towers.diagnostics.progress import PROGRESS
from towers.launch.job_end import JobEndView
from towers.strategies._named import PartialCollectiveError
from towers.strategies.context import PeerLostError

__all__ = ["GroupAgreement"]

log = get_logger(__name__)

#: The published call that waits for the others (one at a time: a call completes before any process goes on).
_WAITING = "waiting"
#: The last process that began a step: ``"<rank> <committed steps>"``.
_BEGAN = "began"
#: Seconds a store request may take (the agent's store is local to the job; a slow answer is a gone store).
_STORE_TIMEOUT_S = 10.0
#: The longest pause between two looks at a waiting call's end key (the job's end record is read as often).
_LOOK_S = 0.25


class GroupAgreement:
    """This process's side of the agreement on named collectives across replica groups (see the module docstring)."""

    def __init__(self, info: ProcessInfo, *, group: int, group_size: int, job_end: JobEndView, timeout_s: float,
                 peer_timeout_s: float, leave: Callable[[], None]) -> None:
        self._info, self._group, self._group_size = info, group, group_size
        self._job_end, self._timeout_s, self._peer_timeout_s, self._leave = job_end, timeout_s, peer_timeout_s, leave
        self._ack_s = ACK_S  # how long a verdict waits for the processes missing from the call to take it
        self._usable = bool(info.agent_store and info.master_port is not None and info.world_size > 1)
        self._store: Any = None
        self._at = (-1, 0)  # (committed step, named calls made at it)
        self._agreed: NamedCall | None = None
        self._arrived: deque[str] = deque(maxlen=16)  # the calls this process counted itself in

    def _client(self) -> Any:
        if self._store is None and self._usable:
            from torch.distributed import PrefixStore, TCPStore

            try:
                store = TCPStore(self._info.master_addr, int(self._info.master_port or 0), is_master=False,
                                 wait_for_workers=False, timeout=timedelta(seconds=_STORE_TIMEOUT_S))
            except Exception as exc:  # noqa: BLE001 - torch's store errors; the collectives run as without it
                log.warning("replica group %d: the job's store at %s:%s cannot be reached (%s): a collective that not "
                            "every replica group calls will only fail on its timeout", self._group,
                            self._info.master_addr, self._info.master_port, exc)
                self._usable = False
                return None
            self._store = PrefixStore(f"towers/attempt_{self._info.restart_count}/ft/named", store)
        return self._store

    def agree(self, *, step: int, expected: int) -> None:
        """Return once all ``expected`` processes of the live groups entered this process's named call (once per
        call: its later collectives pass); at once where no agreement is possible.

        Raises:
            PartialCollectiveError: a process went on without the call (or called another one here), a group's
                script ended without it, or not every process came within ``timeout_s``.
        """
        call = PROGRESS.named
        if call is None or call is self._agreed:
            return
        self._agreed = call
        store = self._client() if expected > 1 else None
        if store is None:
            return
        k = self._at[1] + 1 if self._at[0] == step else 1
        self._at = (step, k)
        base = f"{step}/{k}"
        end, counter = f"{base}/end", f"{base}/{call.tag}"
        self._arrived.append(base)
        previous = store.get(_WAITING) if store.check([_WAITING]) else b""
        store.set(_WAITING, json.dumps({"rank": self._info.rank, "group": self._group, "base": base, "step": step,
                                        "tag": call.tag, "operation": call.operation, "fix": call.fix,
                                        "since": call.since, "counter": counter, "expected": expected}))
        other = json.loads(previous) if previous else None
        if other is not None and other["base"] == base and int(other["tag"]) != call.tag:
            store.compare_set(end, "", json.dumps({  # two named calls at the same point of the loop
                "kind": "different", "caller": other["rank"], "operation": other["operation"], "fix": other["fix"],
                "missing": self._info.rank, "other_operation": call.operation}))
        elif store.add(counter, 1) >= expected:
            store.delete_key(_WAITING)  # before "ok": no process can be past this call yet, nor publish a newer one
            store.compare_set(end, "", "ok")  # a verdict written first stays
        value = self._await_end(store, end, counter, call, expected, step)
        if value.startswith(b"lost "):
            raise PeerLostError(
                f"replica group {self._group}: {call.operation} waited for the live replica groups, and "
                f"{value.decode()[5:]} was lost and started again meanwhile: it cannot take part. Call it again after "
                "the next step (its quorum leaves the lost group out, or heals it).")
        if value != b"ok":
            self._take(store, json.loads(value), end, counter, expected)

    def _await_end(self, store: Any, end: str, counter: str, call: NamedCall, expected: int, step: int) -> bytes:
        deadline, pause = time.monotonic() + self._timeout_s, 0.01
        while not store.check([end]):
            ended, size = self._job_end.noted(), self._group_size
            verdict = {"kind": "missing", "caller": self._info.rank, "operation": call.operation, "fix": call.fix,
                       "waited_s": time.time() - call.since}
            if ended is not None:  # a group's script ended: it will not come
                verdict.update(missing=ended.group * size, where=f"ended (its script finished or failed: replica "
                                                                 f"group {ended.group}) without calling it")
                if store.compare_set(end, "", json.dumps(verdict)) == json.dumps(verdict).encode():
                    store.append(f"{end}/who", ",".join(str(ended.group * size + m) for m in range(size)) + ",")
                    store.add(f"{end}/acks", size)  # nothing more to wait for from processes that ended
                continue
            began = (store.get(_BEGAN) if store.check([_BEGAN]) else b"").split()
            if began and int(began[0]) != self._info.rank and int(began[1]) >= step:  # went on without the call
                missing = int(began[0])
                verdict.update(missing=missing, where=f"began the job's next step (after {step} committed) in replica "
                                                      f"group {missing // size}")
                self._leave()  # its quorum waits for this group: without it, the quorum forms and it looks again
                store.compare_set(end, "", json.dumps(verdict))
                self._ack_s = ACK_S + 2 * self._peer_timeout_s
                continue
            if time.monotonic() > deadline:
                arrived = store.add(counter, 0)
                self._job_end.failed(f"PartialCollectiveError: {call.operation} not called by every replica group")
                raise PartialCollectiveError(
                    f"[rank {self._info.rank}/{self._info.world_size}] {call.operation} waited {self._timeout_s:g} s "
                    f"(quorum_timeout_s) for the live replica groups' processes and {arrived} of {expected} called it. "
                    f"It is a collective: every replica must call it, at the same point of the loop. {call.fix}")
            time.sleep(pause)  # a poll of the store, as named.await_acks polls (a bounded wait per look)
            pause = min(_LOOK_S, pause * 1.5)
        return bytes(store.get(end))

    def check(self, *, step: int, where: str) -> None:
        """Raise when a process of the live groups waits in a named call this process never made (it ``where``).

        One store read (two with a call waiting). Call it where this process goes on past the point where
        the call was due: at the beginning of a step, and when a collective over the groups failed.

        Raises:
            PartialCollectiveError: naming the call, the caller, this process and the fix (the job ends with it).
        """
        store = self._client()
        if store is None:
            return
        try:
            store.set(_BEGAN, f"{self._info.rank} {step}")  # a caller that published after the read below sees it
            raw = store.get(_WAITING) if store.check([_WAITING]) else b""
        except Exception:  # noqa: BLE001 - a store that went away (the job is ending): nothing to look at
            return
        other = json.loads(raw) if raw else None
        if (other is None or other["base"] in self._arrived or int(other["rank"]) == self._info.rank
                or int(other["step"]) > step):
            return  # none waits; this process made that call; or it is behind the caller (healing)
        end = f"{other['base']}/end"
        verdict = json.dumps({"kind": "missing", "caller": other["rank"], "operation": other["operation"],
                              "fix": other["fix"], "waited_s": time.time() - float(other["since"]),
                              "missing": self._info.rank, "where": where})
        value = store.compare_set(end, "", verdict)
        if value == b"ok" or value.startswith(b"lost "):
            return  # the call completed meanwhile (with every process it needed), or was given up (a lost group)
        store.append(f"{end}/who", f"{self._info.rank},")  # missing from it, whoever told the verdict first
        store.add(f"{end}/acks", 1)
        self._take(store, json.loads(value), end, str(other["counter"]), int(other["expected"]))

    def lost(self) -> None:
        """Tell the processes waiting in a named call that this group, started again, was lost (before its first
        step): they raise ``PeerLostError`` instead of waiting for it."""
        store = self._client()
        try:
            raw = store.get(_WAITING) if store is not None and store.check([_WAITING]) else b""
            if raw:
                store.compare_set(f"{json.loads(raw)['base']}/end", "", f"lost replica group {self._group}")
                store.compare_set(_WAITING, raw, "")  # given up: the live groups need not look at it again
        except Exception:  # noqa: BLE001 - a store that went away: nobody waits there
            return

    def _take(self, store: Any, verdict: dict[str, Any], end: str, counter: str, expected: int) -> NoReturn:
        """Note the job's failure, wait until the processes missing from the call took the verdict, raise it."""
        text = describe(verdict, self._info.rank, self._info.world_size)
        # This group's supervisor does not start it again: the job ends (the note is its one line's reason).
        self._job_end.failed(f"PartialCollectiveError: {verdict['operation']} not called by every replica group")
        if verdict.get("kind") != "missing":
            raise PartialCollectiveError(text)
        try:
            deadline, pause = time.monotonic() + self._ack_s, 0.01
            while store.add(f"{end}/acks", 0) < expected - store.add(counter, 0) and time.monotonic() < deadline:
                time.sleep(pause)  # a poll of the store (named.await_acks's, with this call's bound)
                pause = min(_LOOK_S, pause * 1.5)
            who = store.get(f"{end}/who") if store.check([f"{end}/who"]) else b""
            ranks = sorted({int(r) for r in who.decode().split(",") if r})
        except Exception:  # noqa: BLE001 - the store went away: the verdict is told as it was written
            ranks = []
        if ranks:
            verdict["missing_ranks"] = ranks
            text = describe(verdict, self._info.rank, self._info.world_size)
        raise PartialCollectiveError(text)
