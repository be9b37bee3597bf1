"""The steps of a FaultTolerantStrategy: each step's quorum (where a group that is behind heals), its commit vote.

``QuorumSteps`` is the part of the strategy that says where the job is: the live groups of the
step in progress and this process's place among them, the steps committed so far, and the
quorum each step joins before it computes (the job's first step waits for every launched group).
``FaultTolerantStrategy`` builds on it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

from torch import nn

from towers._logging import get_logger
from towers.data._batch import BatchInfo, find_batch_info
from towers.errors import FailedPreconditionError, user_error
from towers.launch.job_end import JobComplete, JobEndView
from towers.strategies.base import ReplicaContext, Strategy
from towers.strategies.fault_tolerant.agreement import GroupAgreement
from towers.strategies.fault_tolerant.grads import GradientSync
from towers.strategies.fault_tolerant.groups import QuorumClient, quorum_started

__all__ = ["QuorumSteps", "Steps"]

log = get_logger(__name__)

#: Seconds between quorum requests while the job's first step waits for a launched group.
_FIRST_QUORUM_POLL_S = 0.2


class Steps:
    """Where the job is: the quorum of the step in progress (opened once, closed by the commit vote)."""

    def __init__(self) -> None:
        self.open = False
        self.not_committed = 0


class QuorumSteps(Strategy):
    """The quorum of each step and its commit vote, over the state ``FaultTolerantStrategy.__init__`` builds."""

    replica_group_id: int
    group_size: int
    group_rank: int
    peer_timeout_s: float
    shard: bool
    _manager: Any  # torchft's Manager
    _quorum_client: QuorumClient
    _intra: Any  # the process group of this replica group's own processes (None: a group of one)
    _steps: Steps
    _members: list[int] | None
    _group_synced: bool
    _gradient_syncs: list[GradientSync]
    _user_modules: list[nn.Module]
    _lighthouse: str
    _quorum_timeout_s: float
    _job_end: JobEndView  # the launcher's record that the job's training ended; this group's note that it joined
    _agreement: GroupAgreement  # named collectives (Metric.result()) across the groups

    # --- the live groups ------------------------------------------------------------------------------
    @property
    def live_replicas(self) -> int:
        """The processes of the groups in the current step's quorum (``group_size`` before the first step): who
        splits the step's global batch and sums its gradients."""
        return max(1, self._manager.num_participants()) * self.group_size

    @property
    def replica_id(self) -> int:
        """This process's place among them: its group's rank in the quorum times ``group_size``, plus its rank in the
        group (``group_rank`` before the first step)."""
        rank = self._manager.participating_rank()
        return (0 if rank is None else int(rank)) * self.group_size + self.group_rank

    @property
    def current_step(self) -> int:
        """Steps committed by the job so far (the same on every live group; a healed group gets the peers' count)."""
        return int(self._manager.current_step())

    @property
    def steps_not_committed(self) -> int:
        """Steps this group computed that did not commit (a group was lost or healing failed mid-step)."""
        return self._steps.not_committed

    # --- steps ----------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Join the quorum of the next step (once per step); a group that is behind heals here, from a live peer."""
        if self._steps.open:
            return
        if not self._user_modules:
            raise FailedPreconditionError("FaultTolerantStrategy: a step began before any model was prepared. Expected "
                                          "`model, optimizer = strategy.prepare(model, optimizer)` before iterating the dataset "
                                          "or calling strategy.run (a healing group loads the live state into them).")
        if not quorum_started(self._manager):  # this group's first step: is there still a job to join?
            self._end_if_job_complete()
            self._agreement.lost()  # started again: a named call that waited for this group cannot complete
        else:  # a live group that goes on while another waits in a named call (result() on the chief alone) ends it
            self._agreement.check(step=self.current_step, where=f"began the job's next step (after {self.current_step} "
                                  f"committed) in replica group {self.replica_group_id}")
        self._start_quorum()
        if self.current_step == 0:
            self._await_launched_groups()
        self._job_end.joined()  # a group of the job now: its supervisor lets it end with the job
        self._steps.open = True
        self._note_members()
        if self._intra is not None and not self._group_synced and not self.shard:
            self._sync_group()

    def _start_quorum(self) -> None:
        try:
            self._manager.start_quorum()
        except Exception as exc:  # torchft raises the RPC's TimeoutError or a connection error
            # A process of this group that waits in a named call left (its group's server with it): say why.
            self._agreement.check(step=self.current_step, where=f"began the job's next step (after "
                                  f"{self.current_step} committed) in replica group {self.replica_group_id}")
            raise FailedPreconditionError(
                f"replica group {self.replica_group_id}: no quorum from the lighthouse {self._lighthouse} within "
                f"quorum_timeout_s={self._quorum_timeout_s} ({type(exc).__name__}: {exc}). The lighthouse is the job's "
                f"single point: without it every group stops at its last committed step ({self.current_step}). "
                "Restart the lighthouse, then the groups (from the last checkpoint).") from exc

    def _await_launched_groups(self) -> None:
        """Ask for quorums until one holds every launched group, while the job has committed no step.

        The lighthouse forms a quorum of whichever groups ask (``min_replicas``), so groups that start
        at different times could each commit the job's steps in quorums of their own: a group that
        starts late, or is started again after the others left, would train the whole job alone and
        end with other parameters. The first step therefore waits for every launched group (each in
        this quorum sees the same members and decides alike); from then on a group that comes back
        heals to the live step, as torchft does.

        Raises:
            RuntimeError: when the launched groups are not all there within ``quorum_timeout_s``.
        """
        launched = max(1, self.num_replicas_in_sync // self.group_size)
        deadline = time.monotonic() + self._quorum_timeout_s
        said = False
        while self.current_step == 0 and self._manager.num_participants() < launched:
            self._end_if_job_complete()  # the live groups may have ended the job while this group was starting
            if not said:
                log.info("replica group %d: the job's first step waits for all %d launched replica groups (%d here)",
                         self.replica_group_id, launched, self._manager.num_participants())
                said = True
            if time.monotonic() > deadline:
                members = self._quorum_client.members
                raise user_error(
                    f"the job's first step needs all {launched} launched replica groups in one quorum",
                    f"replica group(s) {members if members is not None else '?'} within quorum_timeout_s="
                    f"{self._quorum_timeout_s} (this is replica group {self.replica_group_id})",
                    "Start every replica group (towers launch does); a group started again after the others ended "
                    "has no live group to heal from: the job is over. Groups started by hand: give each the job's "
                    "process count as ProcessInfo.world_size.", cls=RuntimeError)
            time.sleep(_FIRST_QUORUM_POLL_S)  # between quorum requests: the lighthouse answers at once
            self._start_quorum()

    def _end_if_job_complete(self) -> None:
        """Exit 0 (``JobComplete``) when the job's training ended before this group took part in any step.

        A group started again after the job's last committed step would otherwise wait ``quorum_timeout_s``
        for groups that are gone, fail, and be started again. The launcher's supervisors record the end
        (``towers.launch.job_end``: on this node the supervisor itself stops the group; this reads the
        record of the groups on other nodes); groups started by hand have no such record.
        """
        end = self._job_end.ended()
        if end is None:
            return
        log.warning("replica group %d found the job complete: %s, before this group took part in a step; nothing "
                    "is left to train, so it exits 0 and is not started again", self.replica_group_id, end.describe())
        self.shutdown()
        raise JobComplete(end)

    def _sync_group(self) -> None:
        """Make the group's processes hold process 0's parameters and buffers, once, after their first quorum.

        torchft heals process r of a group from process r of a live group, and at the job's first step
        (every group at step 0, each with its own initial weights) process 0 and process 1 of a group
        may take them from different groups: without this, a group's processes would start apart.
        """
        import torch.distributed as dist

        for module in self._user_modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0, group=self._intra)
        self._group_synced = True

    def _note_members(self) -> None:
        """Log the groups that left or joined the quorum since the last step (named by their group ids)."""
        members = self._quorum_client.members
        before, self._members = self._members, members
        if before is None or members is None or members == before:
            return
        left, joined = sorted(set(before) - set(members)), sorted(set(members) - set(before))
        if left:
            log.warning("replica group %d: replica group(s) %s left the quorum at step %d (dead, stopped or unreachable "
                        "for peer_timeout_s=%s); training on with %d group(s)", self.replica_group_id,
                        ", ".join(map(str, left)), self.current_step, self.peer_timeout_s, len(members))
        if joined:
            log.info("replica group %d: replica group(s) %s joined the quorum at step %d (%d group(s))",
                     self.replica_group_id, ", ".join(map(str, joined)), self.current_step, len(members))

    def join_job(self) -> None:
        """Join the job if this group has taken part in no step yet: a group started again heals here (``begin_step``)."""
        if not quorum_started(self._manager):
            self.begin_step()

    def step_in_progress(self) -> bool:
        """True between a step's quorum and its commit vote."""
        return self._steps.open

    def _commit(self) -> bool:
        """The commit vote of the step in progress: True when every live group's all-reduce succeeded."""
        self.begin_step()
        committed = bool(self._manager.should_commit())
        self._steps.open = False
        for sync in self._gradient_syncs:
            sync.step_done()
        if not committed:
            self._steps.not_committed += 1
            log.warning("replica group %d: step %d did not commit (%s); its update is dropped and the same global "
                        "batch is retried over the groups still alive", self.replica_group_id, self.current_step,
                        self._manager.errored() or "not enough replica groups")
        return committed

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Call ``fn(*args, **kwargs)`` as this group's step, in the quorum of the step (joined here if not yet)."""
        kwargs = dict(kwargs or {})
        self._own_random_stream()
        self.begin_step()
        with self._entered(self._replica_context(find_batch_info(args, kwargs))):
            return fn(*args, **kwargs)

    def _replica_context(self, batch: BatchInfo | None) -> ReplicaContext:
        context = (ReplicaContext(self) if batch is None else
                   ReplicaContext(self, global_batch_size=batch.examples_per_update,
                                  num_padding_examples=batch.num_padding_examples))
        context.num_replicas_in_sync = self.live_replicas  # who sums this step's gradients
        return context

    @property
    def _sums_replica_gradients(self) -> bool:
        return False  # its own optimizer steps on a committed step; losses are checked by its own rules
