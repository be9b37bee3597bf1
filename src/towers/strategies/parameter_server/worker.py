"""A worker's model bound to the ps shards, and the optimizer whose ``step()`` pushes and pulls.

On a CPU worker every parameter becomes a view of its shard's flat buffer, so a pull lands
directly in the model (no copy); gradients are copied into a flat gradient buffer per shard
and sent in one message per ps task. When the ps task runs on the same host, both buffers are
shared memory (``shared.py``): the ps reads the gradients and writes the parameters in place,
and the message carries only its header. The optimizer the user built is never stepped locally:
the ps tasks rebuild it from its class, ``defaults`` and param-group hyperparameters, and
hyperparameter changes (an LR scheduler's ``lr``) travel with the next push.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn

from towers._logging import get_logger
from towers.errors import InvalidArgumentError
from towers.strategies._copies import DetachedHook
from towers.strategies.parameter_server.client import ParameterClient
from towers.strategies.parameter_server.dispatch import pack_unit
from towers.strategies.parameter_server.requests import hyperparameters, optimizer_name, optimizer_spec
from towers.strategies.parameter_server.sharding import SEGMENT_MIN_BYTES, FlatLayout, assign_shards, model_signature
from towers.strategies.parameter_server.shared import (
    ROOM_SHARE,
    SHARED_DIR,
    TOKEN_BYTES,
    SharedBuffer,
    create,
    new_token,
    room,
    sweep,
)
from towers.strategies.parameter_server.transport import Op
from towers.strategies.parameter_server.wire import encode

__all__ = ["BoundModel"]

log = get_logger(__name__)


class BoundModel:
    """The parameters of one worker's model, laid out per ps shard, with push/pull/state operations."""

    def __init__(self, model: nn.Module, client: ParameterClient, *, num_ps: int, is_chief: bool,
                 optimizer: torch.optim.Optimizer | None, on_dead: Callable[[int], None], overlap: bool = False,
                 shared_memory: bool = False, generation: int = 0):
        self.model, self.client, self.is_chief, self.on_dead = model, client, is_chief, on_dead
        #: Which of the job's models this is (0, 1, ...: the order the script prepares them, the same on every
        #: worker): a later one replaces the earlier one on the ps tasks, starting from its own values.
        self.generation = generation
        #: Read a push's reply during the next step (async mode): the ps updates while this worker computes.
        self.overlap = overlap
        self._stage_bufs: list[torch.Tensor] | None = None  # where an overlapped reply lands
        self._stage_views: list[list[torch.Tensor]] = []
        named = list(model.named_parameters())
        if not named:
            raise InvalidArgumentError(f"{type(model).__name__} has no parameters, so there is nothing for the parameter "
                                       "servers to hold. Pass a model with at least one nn.Parameter.")
        self.params = [p for _, p in named]
        self.signature = model_signature(named)
        self.shards = assign_shards(self.signature, num_ps)
        self.layouts = [FlatLayout([self.signature[i] for i in shard]) for shard in self.shards]
        self.active = [i for i, layout in enumerate(self.layouts) if layout.nbytes]
        self.optimizer = optimizer
        self.opt_groups, self.local_to_global, self.group_ids = _optimizer_layout(optimizer, self.params, self.shards)
        #: per ps task: (gradient file, parameter file, token) offered at registration (an overlapped reply
        #: lands in a second buffer while the model computes, so overlap keeps to the wire)
        self._offered = self._shared_buffers() if shared_memory and not overlap else {}
        self.param_bufs = [self._offered[p][1].tensor if p in self._offered else layout.new_buffer()
                           for p, layout in enumerate(self.layouts)]
        self.grad_bufs = [self._offered[p][0].tensor if p in self._offered else layout.new_buffer()
                          for p, layout in enumerate(self.layouts)]
        #: the ps tasks that mapped this worker's files: their pushes and replies carry only headers
        self.shared: set[int] = set()
        #: bytes moved through shared memory instead of the wire (gradients out, parameters in)
        self.shared_bytes = 0
        self.param_views = [layout.views(b) for layout, b in zip(self.layouts, self.param_bufs)]
        self.grad_views = [layout.views(b) for layout, b in zip(self.layouts, self.grad_bufs)]
        self.segments = [layout.segments(SEGMENT_MIN_BYTES) for layout in self.layouts]
        self._sent_hyper: list[bytes | None] = [_hyper_key([h for h, _ in groups]) for groups in self.opt_groups]
        self.versions: list[int] = [0] * num_ps
        self.dead_seen = 0
        self.pushes = 0
        #: ``bitwise=True``: what holds the step's subtrees (``parameter_server/bitwise.py``); None: ``p.grad`` is pushed
        self.tree: Any = None
        for shard, views in zip(self.shards, self.param_views):
            for i, view in zip(shard, views):
                view.copy_(self.params[i].detach())
        self._rebind()

    def _shared_buffers(self) -> dict[int, tuple[SharedBuffer, SharedBuffer, str]]:
        """A gradient and a parameter file per active shard, or none when this host cannot make them."""
        made: dict[int, tuple[SharedBuffer, SharedBuffer, str]] = {}
        if not os.path.isdir(SHARED_DIR):  # not Linux: nothing to tell, the wire is the only way
            log.debug("no %s on this host: gradients and parameters travel on the wire", SHARED_DIR)
            return made
        sweep()  # files of towers processes that died before their ps answered
        needed, free = 2 * sum(self.layouts[p].nbytes for p in self.active), room()
        if needed > free * ROOM_SHARE:
            log.info("no shared memory for the ps links: they need %.1f MB, more than %.0f%% of the %.1f MB free in "
                     "%s; gradients and parameters travel on the wire (give the host or container more shared "
                     "memory, e.g. docker run --shm-size)", needed / 1e6, 100 * ROOM_SHARE, free / 1e6, SHARED_DIR)
            return made
        created: list[SharedBuffer] = []
        try:
            for p in self.active:
                for _ in range(2):  # one at a time: a file made before a failure is removed with the others
                    created.append(create(self.layouts[p].nbytes))
                grads, params, token = created[-2], created[-1], new_token()
                grads.tensor[:TOKEN_BYTES] = torch.frombuffer(bytearray.fromhex(token), dtype=torch.uint8)
                made[p] = (grads, params, token)
        except OSError as exc:
            _unlink(created)
            log.info("no shared memory for the ps links (%s): gradients and parameters travel on the wire", exc)
            return {}
        return made

    def _rebind(self) -> None:
        """Make every CPU parameter a view of its shard buffer again (after ``.to()`` or ``assign=True`` loads)."""
        for shard, views in zip(self.shards, self.param_views):
            for i, view in zip(shard, views):
                p = self.params[i]
                if p.device.type == "cpu" and p.data_ptr() != view.data_ptr():
                    view.copy_(p.detach())
                    p.data = view

    def _to_params(self) -> None:
        """Copy pulled values into parameters that are not views (non-CPU devices)."""
        with torch.no_grad():
            for shard, views in zip(self.shards, self.param_views):
                for i, view in zip(shard, views):
                    p = self.params[i]
                    if p.data_ptr() != view.data_ptr():
                        p.copy_(view, non_blocking=False)

    def register(self) -> None:
        """Register the model (and optimizer spec) with every ps task; the chief's values become the start values."""
        try:
            signature = [[s.name, list(s.shape), s.dtype] for s in self.signature]
            metas = [{"worker": self.client.worker, "chief": self.is_chief, "signature": signature,
                      "shard": shard, "optimizer": self._spec(p), "generation": self.generation}
                     for p, shard in enumerate(self.shards)]
            for p, (grads, params, token) in self._offered.items():
                metas[p]["shared"] = {"grads": grads.path, "params": params.path, "token": token}
            replies = self.client.request(Op.REGISTER, metas=metas, flats=self.param_bufs if self.is_chief else None,
                                          replies_into=self.param_bufs)
        finally:  # mapped by the ps or refused: no name is needed now
            _unlink([buf for grads, params, _ in self._offered.values() for buf in (grads, params)])
        self.shared = {p for p, r in enumerate(replies) if p in self._offered and isinstance(r.meta, dict)
                       and r.meta.get("shared") is True}
        for p in self._offered:
            self.grad_bufs[p][:TOKEN_BYTES].zero_()
        if self._offered:
            log.debug("ps tasks sharing memory with this worker: %s of %s", sorted(self.shared), sorted(self._offered))
        self.versions = [r.ints[0] for r in replies]
        self._to_params()

    def _spec(self, p: int) -> dict[str, Any] | None:
        if self.optimizer is None:
            return None
        spec = optimizer_spec(self.optimizer, self.opt_groups[p])
        return {**spec, "exact": True} if self.tree is not None else spec  # bitwise: torch's own kernel choice

    def push_pull(self, empty: bool = False, units: list[Any] | None = None) -> None:
        """Send every shard's gradients (and changed hyperparameters); receive the updated parameters in place.

        ``empty``: the step had no example; its push updates nothing (an optimizer with momentum would
        otherwise still move) but counts as the step, like everyone else's, in a sync round.
        ``units``: the dispatched batches whose gradients this push carries (told to ps task 0).
        """
        self.client.finish()  # the previous push's reply (overlap): its parameters become the model's
        self._rebind()
        metas: list[Any] = []
        pieces: list[list[torch.Tensor]] = []
        packed = pack_unit(units)
        tree = self.tree.take() if self.tree is not None else None  # bitwise=True: the step's subtrees
        for p in self.active:
            meta: dict[str, Any] = {}
            if tree is not None:  # this shard of each subtree; the ps sums them over the tree
                piece, mask = tree.shard_rows(p)
                pieces.append(piece)
                meta["tree"] = tree.meta
            else:
                mask = self._gradients_out(p, empty, pieces)
            if not all(mask):
                meta["mask"] = mask
            hyper = self._hyper(p)
            if hyper is not None:
                meta["hyper"] = hyper
            if p == 0 and units and packed is None:
                meta["units"] = units
            metas.append(meta or None)
        # ps task 0 holds none of these parameters: it is told apart that the units were applied, once they were
        told = list(units) if units and 0 not in self.active else None
        if self.overlap:
            if self._stage_bufs is None:
                self._stage_bufs = [layout.new_buffer() for layout in self.layouts]
                self._stage_views = [layout.views(b) for layout, b in zip(self.layouts, self._stage_bufs)]
            self.client.start(Op.PUSH, ps=self.active, metas=metas, flat_parts=pieces, ints=packed or (),
                              replies_into=[self._stage_bufs[p] for p in self.active],
                              on_replies=lambda replies: self._staged(replies, told))
            self.pushes += 1
            return
        replies = self.client.request(Op.PUSH, ps=self.active, metas=metas, flat_parts=pieces,
                                      replies_into=[self.param_bufs[p] for p in self.active], ints=packed or ())
        self.pushes += 1
        if told:
            self.client.batches_applied(told)
        self.note_replies(replies)
        self._to_params()

    def _gradients_out(self, p: int, empty: bool, pieces: list[list[torch.Tensor]]) -> list[bool]:
        """Lay shard ``p``'s gradients out for a push (appended to ``pieces``); return which parameters carry one."""
        mask, direct = [], {}
        # a large gradient goes out as it is, unless the ps reads this shard from shared memory
        big = {i for _, _, i in self.segments[p] if i is not None} if p not in self.shared else set()
        for pos, (i, view) in enumerate(zip(self.shards[p], self.grad_views[p])):
            grad = self.params[i].grad
            mask.append(grad is not None and not empty)
            if grad is None or empty:
                view.zero_()  # a sync round adds whole buffers: no stale gradient of an earlier step
                continue
            if pos in big and grad.device.type == "cpu" and grad.dtype == view.dtype and grad.is_contiguous():
                direct[pos] = grad.detach().reshape(-1).view(torch.uint8)  # sent as is: no copy
            else:
                view.copy_(grad)
        buf = self.grad_bufs[p]
        if p in self.shared:
            pieces.append([])  # the ps reads this shard's gradients in place and writes the parameters back
            self.shared_bytes += 2 * buf.numel()
        else:
            pieces.append([direct[i] if i in direct else buf[a:b] for a, b, i in self.segments[p]])
        return mask

    def note_replies(self, replies: list[Any]) -> None:
        """Note the ps versions and dead workers a push's replies report."""
        for p, reply in zip(self.active, replies):
            self.versions[p] = reply.ints[0]
            if reply.ints[2] > self.dead_seen:
                self.dead_seen = reply.ints[2]
                self.on_dead(self.dead_seen)

    def _staged(self, replies: list[Any], told: list[Any] | None) -> None:
        """An overlapped push's replies are in the stage buffers: they become the parameters (a swap, no copy)."""
        if told:
            self.client.batches_applied(told)
        self.note_replies(replies)
        assert self._stage_bufs is not None
        for p in self.active:
            self.param_bufs[p], self._stage_bufs[p] = self._stage_bufs[p], self.param_bufs[p]
            self.param_views[p], self._stage_views[p] = self._stage_views[p], self.param_views[p]
        with torch.no_grad():
            for shard, views, old in zip(self.shards, self.param_views, self._stage_views):
                for i, view, before in zip(shard, views, old):
                    param = self.params[i]
                    if param.data_ptr() == before.data_ptr():
                        param.data = view  # a CPU parameter: now a view of the buffer the reply landed in
                    else:
                        param.copy_(view, non_blocking=False)

    def _hyper(self, p: int) -> list[dict[str, Any]] | None:
        """This shard's param-group hyperparameters when they changed since the last push, else None."""
        if self.optimizer is None:
            return None
        hyper = [hyperparameters(self.optimizer.param_groups[g], f"param group {g}") for g in self.group_ids[p]]
        blob = _hyper_key(hyper)
        if blob == self._sent_hyper[p]:
            return None
        self._sent_hyper[p] = blob
        return hyper

    def pull(self) -> None:
        """Replace the local parameters with the ps tasks' current values."""
        self.client.finish()
        replies = self.client.request(Op.PULL, ps=self.active, replies_into=[self.param_bufs[p] for p in self.active])
        for p, reply in zip(self.active, replies):
            self.versions[p] = reply.ints[0]
            if p in self.shared:
                self.shared_bytes += self.param_bufs[p].numel()
        self._to_params()

    def push_params(self) -> None:
        """Overwrite the ps tasks' parameters with this worker's (after ``model.load_state_dict``)."""
        self.client.finish()
        self._rebind()
        with torch.no_grad():
            for shard, views in zip(self.shards, self.param_views):
                for i, view in zip(shard, views):
                    if self.params[i].data_ptr() != view.data_ptr():
                        view.copy_(self.params[i])
        self.client.request(Op.SET_PARAMS, ps=self.active, flats=[self.param_bufs[p] for p in self.active])

    def install_hooks(self, refresh_on_state_dict: bool) -> None:
        """``model.state_dict()`` pulls first (``refresh_on_state_dict``); ``load_state_dict`` pushes after.

        Detached hooks: a copy of the model (``copy.deepcopy``, ``AveragedModel``, pickle) neither pulls nor pushes.
        """
        if refresh_on_state_dict:
            self.model.register_state_dict_pre_hook(DetachedHook(lambda module, prefix, keep_vars: self.pull()))
        self.model.register_load_state_dict_post_hook(DetachedHook(lambda module, incompatible: self.push_params()))


def _unlink(buffers: list[SharedBuffer]) -> None:
    """Remove the files' names (the memory stays mapped where it is)."""
    for buf in buffers:
        buf.unlink()


def _hyper_key(hyper: list[dict[str, Any]]) -> bytes:
    """Bytes that change when any hyperparameter does (tensor values included)."""
    raw, tensors = encode(hyper)
    return raw + b"".join(t.numpy().tobytes() for t in tensors)


def _optimizer_layout(optimizer: torch.optim.Optimizer | None, params: list[nn.Parameter],
                      shards: list[list[int]]) -> tuple[list[list[tuple[dict[str, Any], list[int]]]],
                                                        list[list[int]], list[list[int]]]:
    """Return, per ps: the optimizer groups it builds ``(hyper, shard positions)``, its local->global index map,
    and which of the user's groups those are.

    The global index is torch's numbering in ``optimizer.state_dict()`` (params in group order).

    Raises:
        ValueError: a ps task cannot rebuild the optimizer (its class, a hyperparameter), or a group holds a
            tensor that is not one of ``params``.
    """
    groups_per_ps: list[list[tuple[dict[str, Any], list[int]]]] = [[] for _ in shards]
    local_to_global: list[list[int]] = [[] for _ in shards]
    group_ids: list[list[int]] = [[] for _ in shards]
    if optimizer is None:
        return groups_per_ps, local_to_global, group_ids
    optimizer_name(optimizer)  # refused here, before anything is sent
    hypers = [hyperparameters(group, f"param group {g}") for g, group in enumerate(optimizer.param_groups)]
    model_index = {id(p): i for i, p in enumerate(params)}
    position = [{mi: pos for pos, mi in enumerate(shard)} for shard in shards]
    owner = {mi: s for s, shard in enumerate(shards) for mi in shard}
    global_index = 0
    members: list[list[list[tuple[int, int]]]] = [[[] for _ in optimizer.param_groups] for _ in shards]
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in model_index:
                raise InvalidArgumentError(
                    f"The optimizer's param group {g} holds a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of the model passed to strategy.prepare(). Build the optimizer from "
                    "model.parameters() (or subsets of them).")
            mi = model_index[id(p)]
            members[owner[mi]][g].append((position[owner[mi]][mi], global_index))
            global_index += 1
    for s in range(len(shards)):
        for g in range(len(optimizer.param_groups)):
            if members[s][g]:
                groups_per_ps[s].append((hypers[g], [pos for pos, _ in members[s][g]]))
                local_to_global[s].extend(gi for _, gi in members[s][g])
                group_ids[s].append(g)
    return groups_per_ps, local_to_global, group_ids
