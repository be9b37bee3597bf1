"""A worker's side of the parameter servers: one request/reply exchange at a time with every ps task.

Requests to several ps tasks go out together (Gloo sends are asynchronous) and the replies are
read in ps order, so the shards move in parallel. Every failure becomes a ``DistributedError``
naming this rank, the operation and the ps task; a refused request becomes a ``ValueError``
(bad input) or a ``DistributedError`` with the ps's own message.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from towers.cluster.ray import at_loop_end
from towers.diagnostics import track
from towers.errors import InvalidArgumentError
from towers.process_group import DistributedError
from towers.strategies.parameter_server.transport import Link, LinkError, Message, Op, Status

__all__ = ["ParameterClient"]


class ParameterClient:
    """Send requests to the ps tasks over ``links`` (one per ps task, in ps order) and collect the replies."""

    def __init__(self, links: Sequence[Link], *, worker: int, rank: int, world_size: int, ps_ranks: Sequence[int],
                 timeout_s: float):
        self.links, self.worker, self.rank, self.world_size = list(links), worker, rank, world_size
        self.ps_ranks, self.timeout_s = list(ps_ranks), timeout_s
        # The ps bounds its own waits (rounds, staleness, gathers) by timeout_s and then answers with an
        # error; waiting longer here means a silent ps is a hung or unreachable ps.
        self.reply_timeout_s = timeout_s * 1.5 + 10.0
        self._gather_seq = 0
        self.closed = False
        at_loop_end(self.bye)  # under Ray Train the process outlives the function: the ps tasks must hear of its end
        # A request sent whose replies are not read yet (``start``): read before anything else crosses a link.
        self._pending: tuple[str, list[int], Sequence[torch.Tensor | None] | None,
                             Callable[[list[Message]], None]] | None = None

    def _tag(self) -> str:
        return f"[rank {self.rank}/{self.world_size}]"

    def request(self, op: int, *, ps: Sequence[int] | None = None, metas: Sequence[Any] | None = None,
                flats: Sequence[torch.Tensor | None] | None = None,
                replies_into: Sequence[torch.Tensor | None] | None = None, ints: tuple[int, ...] = (),
                flat_parts: Sequence[list[torch.Tensor]] | None = None) -> list[Message]:
        """Send ``op`` to each ps task in ``ps`` (default: all) and return their replies in the same order.

        ``replies_into[i]`` is the buffer the i-th reply's flat part lands in (in place); ``flat_parts[i]``
        sends the i-th flat part in pieces (instead of ``flats[i]``).

        Raises:
            DistributedError: a ps task is gone, silent past the timeout, or failed the request.
            ValueError: a ps task refused the request as bad input (e.g. a model that does not match).
        """
        name = Op.NAMES.get(op, str(op))
        self.finish()
        with track(f"ps {name}"):  # the stuck-job watchdog sees this worker wait on the ps tasks
            targets = self._send(op, name, ps=ps, metas=metas, flats=flats, ints=ints, flat_parts=flat_parts)
            return self._replies(name, targets, replies_into)

    def start(self, op: int, *, on_replies: Callable[[list[Message]], None], ps: Sequence[int] | None = None,
              metas: Sequence[Any] | None = None, replies_into: Sequence[torch.Tensor | None] | None = None,
              ints: tuple[int, ...] = (), flat_parts: Sequence[list[torch.Tensor]] | None = None) -> None:
        """Send ``op`` now and read its replies later: at ``finish()``, which the next request calls first.

        ``on_replies(replies)`` runs when they are read. Meanwhile the caller computes (the ps tasks
        work on the request at the same time).
        """
        name = Op.NAMES.get(op, str(op))
        self.finish()
        with track(f"ps {name}"):
            targets = self._send(op, name, ps=ps, metas=metas, flats=None, ints=ints, flat_parts=flat_parts)
        self._pending = (name, targets, replies_into, on_replies)

    def finish(self) -> None:
        """Read the replies of the request ``start`` sent, if any, and hand them to its ``on_replies``."""
        if self._pending is None:
            return
        name, targets, replies_into, on_replies = self._pending
        self._pending = None
        with track(f"ps {name}"):
            on_replies(self._replies(name, targets, replies_into))

    def _send(self, op: int, name: str, *, ps: Sequence[int] | None, metas: Sequence[Any] | None,
              flats: Sequence[torch.Tensor | None] | None, ints: tuple[int, ...],
              flat_parts: Sequence[list[torch.Tensor]] | None = None) -> list[int]:
        """Send the request to each target ps task; return the targets."""
        if self.closed:
            raise DistributedError(f"{self._tag()} {name} failed: this worker already shut its parameter-server "
                                   "links down (strategy.shutdown()). Create a new strategy to train again.")
        targets = list(range(len(self.links))) if ps is None else list(ps)
        for i, p in enumerate(targets):
            try:
                self.links[p].send(op, timeout_s=self.timeout_s, ints=ints,
                                   meta=None if metas is None else metas[i],
                                   flat=None if flats is None else flats[i],
                                   flat_parts=None if flat_parts is None else flat_parts[i])
            except LinkError as exc:
                raise self._lost(p, name, exc) from exc
        return targets

    def _replies(self, name: str, targets: list[int],
                 replies_into: Sequence[torch.Tensor | None] | None) -> list[Message]:
        """Read one reply from each target ps task, in order."""
        replies = []
        for i, p in enumerate(targets):
            into = None if replies_into is None else replies_into[i]
            try:
                reply = self.links[p].recv(timeout_s=self.timeout_s, first_timeout_s=self.reply_timeout_s,
                                           flat_out=_into(into))
            except LinkError as exc:
                raise self._lost(p, name, exc) from exc
            if reply.status == Status.BAD_INPUT:
                raise InvalidArgumentError(str(reply.meta))
            if reply.status != Status.OK:
                raise DistributedError(f"{self._tag()} {name} failed on ps task {p} (rank {self.ps_ranks[p]}): "
                                       f"{reply.meta}")
            replies.append(reply)
        return replies

    def _lost(self, p: int, name: str, exc: LinkError) -> DistributedError:
        who = f"ps task {p} (rank {self.ps_ranks[p]})"
        what = (f"{who} did not answer within {self.reply_timeout_s:g} s; it is hung or unreachable"
                if exc.kind == "timeout" else f"{who} is gone: {exc}")
        return DistributedError(
            f"{self._tag()} {name} failed: {what}. The ps tasks hold the model's parameters, so training cannot "
            "go on: look for the ps task's own error, then restart the job (BackupAndRestore resumes from the "
            "last checkpoint).")

    # --- operations ------------------------------------------------------------------------------
    def all_gather(self, value: Any) -> list[tuple[int, Any]]:
        """Return ``[(worker, value), ...]`` of every live worker's ``value``, met at ps task 0."""
        seq = self._gather_seq
        self._gather_seq += 1
        return self.request(Op.GATHER, ps=[0], metas=[(seq, value)])[0].meta

    def next_batches(self, key: str, step: int, spec: dict[str, Any]) -> dict[str, Any]:
        """Ask ps task 0 for the batches of step ``step`` of dataset pass ``key`` (see ``dispatch.py``)."""
        return self.request(Op.DISPATCH, ps=[0], metas=[{"key": key, "step": step, "spec": spec}])[0].meta

    def batches_applied(self, units: list[Any]) -> None:
        """Tell ps task 0 that the gradients of ``units`` were applied (when no dense push of them reaches it)."""
        self.request(Op.DISPATCH, ps=[0], metas=[{"applied": units}])

    def stats(self) -> list[dict[str, Any]]:
        """Return every ps task's versions and counts."""
        return [r.meta for r in self.request(Op.STATS)]

    def bye(self) -> None:
        """Tell every ps task this worker is done (best effort: a gone ps is already done) and close the links."""
        if self.closed:
            return
        try:
            self.finish()
        except (DistributedError, ValueError):
            pass  # best effort, as below
        for link in self.links:
            try:
                link.send(Op.BYE, timeout_s=self.timeout_s)
                link.recv(timeout_s=self.timeout_s)
            except LinkError:
                pass
            link.close()
        self.closed = True


def _into(buffer: torch.Tensor | None) -> Callable[[Any], torch.Tensor | None]:
    """Where a reply's tensor lands: ``buffer`` (None: a tensor of its own)."""
    return lambda meta: buffer
