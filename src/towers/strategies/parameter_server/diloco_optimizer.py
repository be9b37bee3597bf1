"""DiLoCo's optimizer on a worker: the user's (inner) optimizer stepped locally, and every ``sync_every`` steps the
outer push of the parameter change (``diloco.py`` says how a window, a pass and the ps tasks fit together)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from towers.errors import InvalidArgumentError, user_error
from towers.strategies._copies import DetachedHook
from towers.strategies.parameter_server.diloco_codec import DeltaEncoder
from towers.strategies.parameter_server.ps_state import fetch_state, send_state
from towers.strategies.parameter_server.sharding import ParamSpec
from towers.strategies.parameter_server.transport import Op
from towers.strategies.parameter_server.worker import BoundModel
from towers.verify_capture import before_update

if TYPE_CHECKING:
    from towers.strategies.parameter_server.diloco import DiLoCo

__all__ = ["DiLoCoOptimizer", "split_fragments"]


def split_fragments(specs: list[ParamSpec], fragments: int) -> list[set[int]]:
    """Return ``fragments`` sets of parameter indices: contiguous runs of the model's parameters, about equal bytes.

    Raises:
        ValueError: the model has fewer parameters than ``fragments`` (some fragment would be empty).
    """
    n = len(specs)
    if fragments > n:
        raise user_error(f"fragments={fragments} cannot divide a model of {n} parameter tensor(s): every fragment "
                         "needs at least one", f"fragments={fragments}",
                         f"Use fragments <= {n} (fragments=1 syncs the whole model at every outer step).")
    total = sum(s.nbytes for s in specs) or 1
    out: list[set[int]] = [set() for _ in range(fragments)]
    k, cumulative = 0, 0
    for i, spec in enumerate(specs):
        # move to the next fragment once this one has its share of bytes, keeping one parameter per later fragment
        if out[k] and k < fragments - 1 and (cumulative >= (k + 1) * total / fragments or n - i <= fragments - 1 - k):
            k += 1
        out[k].add(i)
        cumulative += spec.nbytes
    return out


class DiLoCoOptimizer(torch.optim.Optimizer):
    """The user's (inner) optimizer stepped locally; every ``sync_every`` steps the change goes to the ps tasks."""

    def __init__(self, optimizer: torch.optim.Optimizer, bound: BoundModel, diloco: DiLoCo, *,
                 step_batches: Callable[[], tuple[bool, list[Any]]], replaced: Callable[[], bool]):
        self.optimizer, self._bound, self._diloco = optimizer, bound, diloco
        self._step_batches, self._replaced = step_batches, replaced
        self._building = True
        super().__init__(optimizer.param_groups, optimizer.defaults)  # shares the user's group dicts (LR schedulers)
        self._building = False
        self.state = optimizer.state
        options = diloco.options
        self._fragments = split_fragments(bound.signature, options.fragments)
        self._encoder = DeltaEncoder(options.compression)
        # the global values as of the last outer step (what a change is measured from); replies land in scratch
        self._anchor = [buf.clone() for buf in bound.param_bufs]
        self._anchor_views = [layout.views(b) for layout, b in zip(bound.layouts, self._anchor)]
        self._scratch = [layout.new_buffer() for layout in bound.layouts]
        self._scratch_views = [layout.views(b) for layout, b in zip(bound.layouts, self._scratch)]
        self._units: list[Any] = []  # the window's dispatched batches, its inner steps and its examples (the weight)
        self._steps, self._weight = 0, 0.0
        self._outer = 0
        self._in_flight = False  # overlap: an outer push whose reply is not read yet
        bound.model.register_load_state_dict_post_hook(DetachedHook(lambda module, incompatible: self._reanchor()))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Take one inner step on this worker; after ``sync_every`` of them, one outer step. Return ``closure()``'s loss."""
        before_update(self)  # `towers verify` records the parameters here; nothing otherwise
        if self._replaced():
            raise user_error("ParameterServerStrategy holds one model at a time on its ps tasks, and a later "
                             "strategy.prepare(...) replaced the model this optimizer steps",
                             f"optimizer.step() of {type(self.optimizer).__name__} over the earlier model",
                             "Train one model after the other under mode='diloco'.")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        empty, units = self._step_batches()
        local, scale = self._diloco.take_examples()
        if not empty and local != 0:
            if scale != 1.0:  # compute_average_loss divided by the global batch: make it this worker's mean
                grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, scale)
            self.optimizer.step()
        self._units.extend(units)
        self._steps += 1
        self._weight += 1.0 if local is None else float(local)
        self._diloco.inner_steps += 1
        self._diloco.examples += local or 0
        if self._in_flight:  # overlap: the last outer push's reply, read after one more inner step
            began = time.perf_counter()
            self._bound.client.finish()
            self._diloco.outer_wait_s += time.perf_counter() - began
        if self._steps >= self._diloco.options.sync_every:
            self.sync()
        return loss

    def settle(self) -> None:
        """Read an overlapped outer push's reply now (the model takes up the new global values)."""
        if self._in_flight:
            self._bound.client.finish()

    def window_units(self) -> list[Any]:
        """The dispatched batches (``[pass, global batch, replica]``) trained since the last outer step."""
        return [list(u) for u in self._units]

    def sync(self) -> None:
        """Push this worker's change since the last outer step and take up the new global values (no-op when the
        window is empty). Every worker calls it at the same inner step: at every ``sync_every``-th, and at the
        end of each pass of a dataset the ps tasks hand out."""
        if self._steps == 0:
            return
        bound, options = self._bound, self._diloco.options
        client = bound.client
        client.finish()
        fragment = self._fragments[self._outer % len(self._fragments)]
        weight = self._weight if options.outer_mode == "sync" else 1.0 / self._diloco.num_workers
        units, metas, flats = self._units, [], []
        for p in bound.active:
            meta: dict[str, Any] = {"weight": weight}
            mask = [i in fragment for i in bound.shards[p]]
            # the whole shard as float32: the push's flat buffer; a part of it, or compressed: packed values
            packed = options.compression != "float32" or not all(mask)
            deltas = []
            with torch.no_grad():
                for pos, i in enumerate(bound.shards[p]):
                    view = bound.grad_views[p][pos]
                    if not mask[pos]:
                        view.zero_()
                        continue
                    delta = self._anchor_views[p][pos] - bound.params[i].detach().to("cpu", view.dtype)
                    if packed:
                        deltas.append((i, delta))
                    else:
                        view.copy_(delta)
            if packed:
                meta["packed"] = self._encoder.pack(deltas)
            flats.append(None if packed else bound.grad_bufs[p])
            if not all(mask):
                meta["mask"] = mask
            if p == 0 and units:
                meta["units"] = units
            metas.append(meta)
        sent, began = sum(link.bytes_sent for link in client.links), time.perf_counter()
        into = [self._scratch[p] for p in bound.active]
        if options.overlap:  # the reply is read after the next inner step; the change is measured from here
            at_send = {i: bound.params[i].detach().clone() for i in fragment}
            client.start(Op.PUSH, ps=bound.active, metas=metas, flat_parts=[[f] if f is not None else [] for f in flats],
                         replies_into=into, on_replies=lambda replies: self._take_up(replies, fragment, units, at_send))
            self._in_flight = True
        else:
            self._take_up(client.request(Op.PUSH, ps=bound.active, metas=metas, flats=flats, replies_into=into),
                          fragment, units, None)
            self._diloco.outer_wait_s += time.perf_counter() - began
        self._diloco.outer_bytes_sent += sum(link.bytes_sent for link in client.links) - sent
        self._steps, self._weight, self._units = 0, 0.0, []
        self._outer += 1
        self._diloco.outer_steps += 1

    def _take_up(self, replies: list[Any], fragment: set[int], units: list[Any],
                 at_send: dict[int, torch.Tensor] | None) -> None:
        """The new global values of ``fragment`` are in: measure changes from them, and train on from them (with
        ``at_send``, the local values the push was taken at: keep the inner steps taken since, on top)."""
        bound = self._bound
        self._in_flight = False
        if units and 0 not in bound.active:  # ps task 0 holds none of these parameters: tell it apart
            bound.client.batches_applied(units)
        bound.note_replies(replies)
        with torch.no_grad():
            for p in bound.active:
                for pos, i in enumerate(bound.shards[p]):
                    if i in fragment:
                        new, param = self._scratch_views[p][pos], bound.params[i]
                        self._anchor_views[p][pos].copy_(new)
                        if at_send is None:
                            param.copy_(new)
                        else:
                            # new + (what the steps since the send changed): exactly new when none did
                            param.copy_(new.to(param.device, param.dtype) + (param - at_send[i]))

    def _reanchor(self) -> None:
        """After ``model.load_state_dict`` (pushed to the ps tasks as the global values): measure changes from there."""
        with torch.no_grad():
            for p, shard in enumerate(self._bound.shards):
                for pos, i in enumerate(shard):
                    self._anchor_views[p][pos].copy_(self._bound.params[i].detach())
        self._encoder.reset()
        self._steps, self._weight = 0, 0.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients."""
        self.optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the ps tasks' shards are fixed at ``prepare``."""
        if not self._building:
            raise InvalidArgumentError("add_param_group after strategy.prepare() is not supported under "
                                       "mode='diloco'. Add every param group before calling prepare().")
        super().add_param_group(param_group)

    @property
    def window_steps(self) -> int:
        """Inner steps taken since the last outer step (0: the model holds the global values it pulled then)."""
        return self._steps

    @property
    def outer(self) -> torch.optim.Optimizer:
        """The outer optimizer as this worker built it over the model: what the ps tasks rebuilt and step."""
        if self._bound.optimizer is None:  # BoundModel was given the outer optimizer at prepare
            raise InvalidArgumentError("this DiLoCo model was bound without its outer optimizer; prepare it again.")
        return self._bound.optimizer

    def outer_state_dict(self) -> dict[str, Any]:
        """Return the outer optimizer's state (its momentum on the ps tasks) in torch's format."""
        return fetch_state(self._bound, self.outer.param_groups)

    def load_outer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Send an outer optimizer state from ``outer_state_dict()`` to the ps tasks.

        Raises:
            ValueError: when its groups or their sizes do not match the outer optimizer's.
        """
        send_state(self._bound, self.outer.param_groups, state_dict)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's state (the outer optimizer's lives on the ps tasks: ``outer_state_dict``)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the inner optimizer's state."""
        self.optimizer.load_state_dict(state_dict)
