"""An exponential moving average (EMA) of a prepared model's weights, the same under every strategy.

What ``torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))`` computes,
without a copy of the model: each process keeps the average of the tensors it holds (a replica's whole
parameters, a sharded model's shards, a pipeline stage's layers) and ``update()`` folds them in without
any communication. The average is elementwise, so the parts together are the whole model's average,
equal to the one the plain one-device loop's ``AveragedModel`` keeps. ``AveragedModel`` itself works on a
model every process holds whole (one process, Mirrored, parameter servers, hybrid, fault tolerant);
a sharded or pipelined model cannot be deep-copied and refuses with an error that points here.

    ema = towers.ExponentialMovingAverage(model, decay=0.999, strategy=strategy)
    for x, y in batches:
        ...; optimizer.step(); optimizer.zero_grad()
        ema.update()
    with ema.average_parameters():       # the model computes with the averages for a while
        evaluate(model)
    weights = ema.full_state_dict()      # your module's state dict, the averages in place of the parameters

``state_dict()``/``load_state_dict()`` make it part of a checkpoint (``save_checkpoint(path, {..., "ema": ema})``).
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
from torch import nn

from towers.checkpoint.state import is_dtensor
from towers.errors import user_error

if TYPE_CHECKING:
    from towers.strategies.base import Strategy

__all__ = ["ExponentialMovingAverage"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds (a DTensor's shard; a plain tensor itself)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


class ExponentialMovingAverage:
    """An exponential moving average of ``model``'s parameters (with ``use_buffers``, of its buffers too).

    ``update()`` after each optimizer step, on every process: the first copies the parameters, each later one
    computes ``average = decay * average + (1 - decay) * parameter`` (torch's ``get_ema_multi_avg_fn``).
    ``num_updates`` counts them. Before the first update the averages are the values at construction.

    Args:
        model: the model ``strategy.prepare`` returned (or any module).
        decay: the weight of the old average, in ``[0, 1]``.
        strategy: the strategy that prepared ``model``. The averages are then named as your module names
            its tensors (so a checkpoint moves between strategies) and ``full_state_dict`` gathers a sharded
            or pipelined model's. Needed for those; without it ``model`` is taken as it is.
        use_buffers: also average floating buffers (BatchNorm's running statistics), as ``AveragedModel(...,
            use_buffers=True)``; other buffers (counters) take the model's values. Without it the model's own
            buffers serve, as ``AveragedModel`` keeps its buffers equal to the model's.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``decay`` is not a number in ``[0, 1]``.
    """

    def __init__(self, model: nn.Module, decay: float = 0.999, *, strategy: "Strategy | None" = None,
                 use_buffers: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise user_error("ExponentialMovingAverage averages a module's weights", type(model).__name__,
                             "Pass the model strategy.prepare returned.", cls=TypeError)
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not (0.0 <= float(decay) <= 1.0) \
                or math.isnan(float(decay)):
            raise user_error("decay must be a number in [0, 1] (the weight of the old average)", repr(decay),
                             "Use e.g. decay=0.999 (the average of about the last 1000 updates).")
        self.decay = float(decay)
        self.use_buffers = bool(use_buffers)
        self.num_updates = 0
        self._model = model
        self._strategy = strategy
        self._module = strategy.unwrap(model) if strategy is not None else model
        live = self._live()
        self.names = _state_dict_names(self._module, live)
        with torch.no_grad():
            self._average = [t.detach().clone() for t in live]

    def _live(self) -> list[torch.Tensor]:
        """The module's parameters (and buffers) now, in a fixed order (read anew: a strategy may swap the objects)."""
        tensors: list[torch.Tensor] = list(self._module.parameters())
        if self.use_buffers:
            tensors += list(self._module.buffers())
        if hasattr(self, "_average") and len(tensors) != len(self._average):
            raise user_error("The model's tensors changed since the ExponentialMovingAverage was made",
                             f"{len(tensors)} tensors, {len(self._average)} averaged",
                             "Make the average after strategy.prepare, from the model it returned, and keep that model.",
                             cls=RuntimeError)
        return tensors

    # --- averaging ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self) -> None:
        """Fold the model's current weights into the average (the first update copies them); no communication."""
        live = [_local(t.detach()) for t in self._live()]
        average = [_local(a) for a in self._average]
        if self.num_updates == 0:
            for a, t in zip(average, live):
                a.copy_(t)
        else:
            floating = [i for i, a in enumerate(average) if a.is_floating_point() or a.is_complex()]
            if floating:  # what get_ema_multi_avg_fn does: one foreach lerp
                torch._foreach_lerp_([average[i] for i in floating], [live[i] for i in floating], 1.0 - self.decay)
            for i in set(range(len(average))) - set(floating):  # counters: the model's value
                average[i].copy_(live[i])
        self.num_updates += 1

    @contextlib.contextmanager
    def average_parameters(self) -> Iterator[nn.Module]:
        """Put the averages into the model for the block (evaluation, export); its own weights come back after.

        Local to each process, no communication: every process enters it (a sharded model's forward gathers the
        averaged shards). Do not train inside it: the weights are restored as they were when it began.
        """
        live = self._live()
        with torch.no_grad():
            saved = [_local(t.detach()).clone() for t in live]
            for t, a in zip(live, self._average):
                _local(t.detach()).copy_(_local(a))
        try:
            yield self._model
        finally:
            with torch.no_grad():
                for t, s in zip(live, saved):
                    _local(t.detach()).copy_(s)

    # --- state ----------------------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, Any]:
        """Return your module's full ``state_dict()`` with the averages in place of its parameters (and buffers).

        Whole tensors, under your module's names: they load into a plain module. Where the model is sharded or
        pipelined it is ``strategy.full_state_dict`` of the averaged model (a collective: every process calls it;
        see there which processes receive the tensors).

        Raises:
            ValueError: a sharded model's average without ``strategy=``.
        """
        if not any(is_dtensor(a) for a in self._average):  # whole tensors here
            state = self._module.state_dict(keep_vars=True)
            averaged = {id(t): a for t, a in zip(self._live(), self._average)}
            return {k: (averaged[id(v)] if id(v) in averaged else v).detach().clone() if isinstance(v, torch.Tensor)
                    else v for k, v in state.items()}
        if self._strategy is None:
            raise user_error("The full state of a sharded model's average is gathered by its strategy",
                             "ExponentialMovingAverage(..., strategy=None)",
                             "Pass strategy=strategy (the one that prepared the model) to ExponentialMovingAverage.")
        with self.average_parameters():  # copied before the weights come back: some entries alias the parameters
            state = self._strategy.full_state_dict(self._model)
            return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"decay", "num_updates", "average": {name: tensor}}`` (a sharded model's: this process's DTensors)."""
        return {"decay": self.decay, "num_updates": self.num_updates,
                "average": {name: a.detach() for name, a in zip(self.names, self._average)}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned, here or under another strategy (whole tensors are cut into this
        process's shards). Names the model does not hold here (another pipeline stage's) are left out.

        Raises:
            ValueError: a name of this model is missing, or a shape differs.
        """
        saved = state.get("average") if isinstance(state, Mapping) else None
        if not isinstance(saved, Mapping):
            raise user_error("An ExponentialMovingAverage state is a dict with 'decay', 'num_updates' and 'average'",
                             type(state).__name__, "Pass what ExponentialMovingAverage.state_dict() returned.")
        missing = [n for n in self.names if n not in saved]
        wrong = [f"{n}: {list(saved[n].shape)} for {list(a.shape)}" for n, a in zip(self.names, self._average)
                 if n in saved and tuple(saved[n].shape) != tuple(a.shape)]
        if missing or wrong:
            raise user_error("The average does not fit this model", f"missing {missing[:5]}, shapes {wrong[:5]}",
                             "Load an average saved from the same model.")
        with torch.no_grad():
            for name, a in zip(self.names, self._average):
                _local(a).copy_(_local(_like(saved[name], a)))
        self.decay = float(state.get("decay", self.decay))
        self.num_updates = int(state.get("num_updates", 0))

    def __repr__(self) -> str:
        return (f"ExponentialMovingAverage(decay={self.decay}, num_updates={self.num_updates}, "
                f"tensors={len(self._average)}, use_buffers={self.use_buffers})")


def _state_dict_names(module: nn.Module, live: list[torch.Tensor]) -> list[str]:
    """Each of ``live``'s names as ``module.state_dict()`` keys it (tied weights: the first; wrappers' prefixes removed)."""
    key_of: dict[int, str] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        key_of.setdefault(id(value), key)
    named = {id(t): n for n, t in [*module.named_parameters(), *module.named_buffers()]}
    return [key_of.get(id(t), named.get(id(t), f"tensor_{i}")) for i, t in enumerate(live)]


def _like(value: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``value`` laid out as ``template``: a whole tensor cut into this process's shard of a DTensor (no communication)."""
    if not is_dtensor(template) or is_dtensor(value):
        return value.to(_local(template).device)
    from torch.distributed.tensor import distribute_tensor

    mesh, placements = template.device_mesh, template.placements  # type: ignore[attr-defined]
    return distribute_tensor(value.to(_local(template).device), mesh, placements, src_data_rank=None)
