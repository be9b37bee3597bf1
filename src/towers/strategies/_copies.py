"""What a copy of a prepared model is: the user's module, with none of the strategy's machinery.

torch code copies models: ``torch.optim.swa_utils.AveragedModel`` (EMA, SWA) deep-copies the model
it averages, a teacher or a target network is ``copy.deepcopy(model)``, ``torch.save(model)`` pickles
it. A prepared model carries the strategy's hooks (the step accounting of a loop without
``strategy.run``, the parameter servers' pull and push) and may sit in a towers wrapper (DDP, the
precision wrapper). A hook that is a bound method of the strategy made every copy copy the strategy
too: its process group, sockets and cluster description (a ``mappingproxy``, which cannot be
pickled). So:

- ``DetachedHook``: a hook a strategy puts on a module runs on the prepared model only. Copied or
  pickled it becomes a no-op: a copy is not prepared (its forward starts no step, its
  ``load_state_dict`` pushes nothing to a ps task), and copying it never copies the strategy.
- towers' wrappers (``TowersDDP``, ``MixedPrecisionModule``) copy and pickle as the user's module they
  wrap (``copy_of_wrapped``, ``reduce_of_wrapped``): a copy of a prepared model is a plain copy of YOUR
  module, the same on one process as on N replicas.
- ``refuse_copies``: a model that no process holds whole (FSDP2's shards, a pipeline stage, a
  ``ShardedEmbedding`` whose rows live on the ps tasks) refuses ``copy.deepcopy`` and ``pickle`` with one
  error that names the ways that work: ``strategy.full_state_dict(model)`` and, for the parts a process
  holds, ``towers.ExponentialMovingAverage``.
"""

from __future__ import annotations

import copy
import copyreg
from typing import Any, Callable, SupportsIndex

from torch import nn

from towers.errors import user_error

__all__ = ["DetachedHook", "IN_PARTS_FIX", "copy_of_wrapped", "reduce_of_wrapped", "refuse_copies", "copy_refused"]


class DetachedHook:
    """A module hook that calls ``fn`` on the prepared model, and does nothing on a copy or an unpickled model."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[..., Any] | None) -> None:
        self._fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Return ``fn(*args, **kwargs)`` (None on a copy)."""
        return None if self._fn is None else self._fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> "DetachedHook":
        return DetachedHook(None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (DetachedHook, (None,))

    def __repr__(self) -> str:
        return f"DetachedHook({'inert' if self._fn is None else getattr(self._fn, '__qualname__', self._fn)})"


def copy_of_wrapped(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """Return ``copy.deepcopy(module, memo)``: what a towers wrapper's ``__deepcopy__`` returns (its user's module)."""
    return copy.deepcopy(module, memo)


def reduce_of_wrapped(module: nn.Module, protocol: SupportsIndex) -> Any:
    """Return ``module.__reduce_ex__(protocol)`` for a towers wrapper's own: the wrapper pickles as the user's module.

    pickle checks that ``copyreg.__newobj__``'s class is the pickled object's, which the wrapper's is not:
    the module is made by its class's own ``__new__`` instead (the same call, and the same torch-only pickle).
    """
    reduced = module.__reduce_ex__(protocol)
    if isinstance(reduced, tuple) and reduced and reduced[0] is copyreg.__newobj__:  # type: ignore[attr-defined]
        cls = reduced[1][0]
        return (cls.__new__, *reduced[1:])
    return reduced


#: What works instead of a copy of a model held in parts.
IN_PARTS_FIX = ("Use strategy.full_state_dict(model) for its whole weights (every process calls it; they load into a "
                "plain module), towers.ExponentialMovingAverage(model, decay=..., strategy=strategy) for an average of its "
                "weights (each process averages the part it holds), and strategy.save_checkpoint(...) for checkpoints.")


def copy_refused(operation: str, model_type: str, where: str, fix: str = IN_PARTS_FIX) -> Exception:
    """Return the error for ``operation`` (``"copy.deepcopy"``, ``"pickle"``) of a model held in parts (``where``)."""
    return user_error(f"{operation} cannot make a copy of this model in one process: {where}",
                      f"{operation} of a {model_type} (torch's AveragedModel deep-copies the model it averages)", fix,
                      cls=TypeError)


class _Refusal:
    """Stands in for a module's ``__deepcopy__`` or ``__reduce_ex__``: raises ``copy_refused``."""

    def __init__(self, operation: str, model_type: str, where: str, fix: str) -> None:
        self._operation, self._model_type, self._where, self._fix = operation, model_type, where, fix

    def __call__(self, *args: Any) -> Any:
        raise copy_refused(self._operation, self._model_type, self._where, self._fix)


def refuse_copies(module: nn.Module, where: str, fix: str = IN_PARTS_FIX) -> None:
    """Make ``copy.deepcopy(module)`` and ``pickle`` of it (or of a model holding it) raise ``copy_refused``.

    ``where`` says why no process holds it whole, ``fix`` what works instead. Set on the instance: FSDP2's
    class (made by ``fully_shard``) has a ``__deepcopy__`` of its own that asserts.
    """
    name = type(module).__name__
    object.__setattr__(module, "__deepcopy__", _Refusal("copy.deepcopy", name, where, fix))
    object.__setattr__(module, "__reduce_ex__", _Refusal("pickle", name, where, fix))
