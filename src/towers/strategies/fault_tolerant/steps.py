"""A FaultTolerantStrategy's place in the job: its replica group's torchft manager, each step's quorum (where a group
that is behind heals) and its commit vote.

``QuorumSteps`` (the strategy holds one) builds the group's store, its own process group and torchft's manager and
process group, and says where the job is: the live groups of the step in progress and this process's place among
them, the steps committed so far, and the quorum each step joins before it computes (the job's first step waits for
every launched group). ``close`` leaves the quorum and stops them.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

from torch import nn

from towers._logging import get_logger
from towers.cluster.info import ProcessInfo
from towers.errors import FailedPreconditionError, user_error
from towers.launch.job_end import JobComplete, JobEndView
from towers.strategies.fault_tolerant.agreement import GroupAgreement
from towers.strategies.fault_tolerant.grads import GradientSync
from towers.strategies.fault_tolerant.groups import (
    GroupLayout,
    import_torchft,
    intra_group,
    note_quorum_members,
    own_address,
    quorum_started,
)
from towers.strategies.fault_tolerant.store import group_store

__all__ = ["QuorumSteps"]

log = get_logger(__name__)

#: Seconds between quorum requests while the job's first step waits for a launched group.
_FIRST_QUORUM_POLL_S = 0.2


class QuorumSteps:
    """The quorum of each step and its commit vote, over this replica group's torchft manager.

    ``user_modules`` are the models the strategy prepared (a healing group loads the live state into them; a group
    of several processes starts from process 0's), ``gradient_syncs`` the gradient all-reduces of their steps.
    """

    def __init__(self, info: ProcessInfo, layout: GroupLayout, *, lighthouse: str | None, address: str | None,
                 peer_timeout_s: float, quorum_timeout_s: float, min_replicas: int, shard: bool) -> None:
        torchft = import_torchft()
        from torchft.manager import MANAGER_ADDR_KEY

        from towers.strategies.fault_tolerant.transport import WireTransport

        self.replica_group_id, self.group_size, self.group_rank = layout.group, layout.size, layout.rank
        self.peer_timeout_s, self.shard = peer_timeout_s, shard
        self.launched_replicas = max(int(info.world_size), layout.size)  # the processes of every replica group
        host = address or own_address(info)
        timeout = timedelta(seconds=peer_timeout_s)
        # The group's own store, served by member 0 on the group's address only: torchft's managers and per-quorum
        # process groups meet there, and so do the members' own process group (groups of several processes).
        self.store = group_store(host, layout.port, serves=layout.rank == 0, timeout_s=quorum_timeout_s)
        self.intra = intra_group(self.store, layout, timeout)  # None: a group of one
        self._pg = torchft.ProcessGroupGloo(timeout=timeout)
        transport = WireTransport(self._pg, timeout)  # the live state as JSON and tensor bytes, never a pickle
        try:
            self.manager = torchft.Manager(
                pg=self._pg, load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
                use_async_quorum=False,  # heal before the forward pass, so a healed group computes on the live weights
                timeout=timeout, quorum_timeout=timedelta(seconds=quorum_timeout_s),
                connect_timeout=timedelta(seconds=quorum_timeout_s), rank=layout.rank, world_size=layout.size,
                store_addr=host, store_port=self.store.port, lighthouse_addr=lighthouse,
                replica_id=f"towers_ft_{self.replica_group_id}", hostname=host, checkpoint_transport=transport)
        except KeyError as exc:  # torchft reads TORCHFT_LIGHTHOUSE when no address is given
            raise user_error("FaultTolerantStrategy needs the address of a torchft lighthouse", f"lighthouse={lighthouse!r} "
                             "and no TORCHFT_LIGHTHOUSE", "Start one (towers.strategies.fault_tolerant.start_lighthouse, "
                             "or torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510) and pass "
                             "lighthouse='http://host:port' to the strategy.") from exc
        # torchft's manager server (process 0 of the group) binds every interface itself: its address is said here.
        self.manager_address: str = self.store.get(MANAGER_ADDR_KEY).decode()
        self._quorum_client = note_quorum_members(self.manager)  # the same client, noting each quorum's members
        self._lighthouse = lighthouse or "(none given)"
        self._quorum_timeout_s = quorum_timeout_s
        self._job_end = JobEndView(info)  # under towers launch: the record that the job's training ended
        # Collectives every replica must call (Metric.result()), agreed across the groups in the job's store.
        self.agreement = GroupAgreement(info, group=self.replica_group_id, group_size=layout.size, job_end=self._job_end,
                                        timeout_s=quorum_timeout_s, peer_timeout_s=peer_timeout_s, leave=self.close)
        self.user_modules: list[nn.Module] = []
        self.gradient_syncs: list[GradientSync] = []
        self.not_committed = 0  # steps this group computed that did not commit
        self._open = False  # between a step's quorum and its commit vote
        self._members: list[int] | None = None
        self._group_synced = False
        self._closed = False
        log.info("FaultTolerantStrategy: replica group %d, process %d of %d (lighthouse %s, peer_timeout_s=%s, "
                 "min_replicas=%d, store %s:%d, torchft manager %s on every interface)", self.replica_group_id,
                 layout.rank, layout.size, lighthouse or "from TORCHFT_LIGHTHOUSE", peer_timeout_s, min_replicas,
                 host, self.store.port, self.manager_address)

    def close(self) -> None:
        """Leave the quorum and stop this group's torchft servers and process groups (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.manager.shutdown(wait=False)
        with contextlib.suppress(Exception):
            self._pg.shutdown()
        if self.intra is not None:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    # --- the live groups ------------------------------------------------------------------------------
    @property
    def live_replicas(self) -> int:
        """The processes of the groups in the current step's quorum (``group_size`` before the first step): who
        splits the step's global batch and sums its gradients."""
        return max(1, self.manager.num_participants()) * self.group_size

    @property
    def replica_id(self) -> int:
        """This process's place among them: its group's rank in the quorum times ``group_size``, plus its rank in the
        group (``group_rank`` before the first step)."""
        rank = self.manager.participating_rank()
        return (0 if rank is None else int(rank)) * self.group_size + self.group_rank

    @property
    def current_step(self) -> int:
        """Steps committed by the job so far (the same on every live group; a healed group gets the peers' count)."""
        return int(self.manager.current_step())

    # --- steps ----------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Join the quorum of the next step (once per step); a group that is behind heals here, from a live peer."""
        if self._open:
            return
        if not self.user_modules:
            raise FailedPreconditionError("FaultTolerantStrategy: a step began before any model was prepared. Expected "
                                          "`model, optimizer = strategy.prepare(model, optimizer)` before iterating the dataset "
                                          "or calling strategy.run (a healing group loads the live state into them).")
        if not quorum_started(self.manager):  # this group's first step: is there still a job to join?
            self._end_if_job_complete()
            self.agreement.lost()  # started again: a named call that waited for this group cannot complete
        else:  # a live group that goes on while another waits in a named call (result() on the chief alone) ends it
            self.agreement.check(step=self.current_step, where=f"began the job's next step (after {self.current_step} "
                                 f"committed) in replica group {self.replica_group_id}")
        self._start_quorum()
        if self.current_step == 0:
            self._await_launched_groups()
        self._job_end.joined()  # a group of the job now: its supervisor lets it end with the job
        self._open = True
        self._note_members()
        if self.intra is not None and not self._group_synced and not self.shard:
            self._sync_group()

    def _start_quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except Exception as exc:  # torchft raises the RPC's TimeoutError or a connection error
            # A process of this group that waits in a named call left (its group's server with it): say why.
            self.agreement.check(step=self.current_step, where=f"began the job's next step (after "
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
        launched = max(1, self.launched_replicas // self.group_size)
        deadline = time.monotonic() + self._quorum_timeout_s
        said = False
        while self.current_step == 0 and self.manager.num_participants() < launched:
            self._end_if_job_complete()  # the live groups may have ended the job while this group was starting
            if not said:
                log.info("replica group %d: the job's first step waits for all %d launched replica groups (%d here)",
                         self.replica_group_id, launched, self.manager.num_participants())
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
        self.close()
        raise JobComplete(end)

    def _sync_group(self) -> None:
        """Make the group's processes hold process 0's parameters and buffers, once, after their first quorum.

        torchft heals process r of a group from process r of a live group, and at the job's first step
        (every group at step 0, each with its own initial weights) process 0 and process 1 of a group
        may take them from different groups: without this, a group's processes would start apart.
        """
        import torch.distributed as dist

        for module in self.user_modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0, group=self.intra)
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

    @property
    def started(self) -> bool:
        """Whether this group has asked for a quorum yet (taken part in a step, or begun one)."""
        return bool(quorum_started(self.manager))

    def step_in_progress(self) -> bool:
        """True between a step's quorum and its commit vote."""
        return self._open

    def commit(self) -> bool:
        """The commit vote of the step in progress: True when every live group's all-reduce succeeded."""
        self.begin_step()
        committed = bool(self.manager.should_commit())
        self._open = False
        for sync in self.gradient_syncs:
            sync.step_done()
        if not committed:
            self.not_committed += 1
            log.warning("replica group %d: step %d did not commit (%s); its update is dropped and the same global "
                        "batch is retried over the groups still alive", self.replica_group_id, self.current_step,
                        self.manager.errored() or "not enough replica groups")
        return committed
