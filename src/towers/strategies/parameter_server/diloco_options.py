"""DiLoCo's options under ``ParameterServerStrategy(mode="diloco")``, checked before anything connects.

``sync_every`` (H): inner steps a worker takes on its own between two outer steps. ``outer_optimizer``: the
optimizer the ps tasks apply to the averaged parameter change, by name (``"nesterov"``: DiLoCo's SGD with
Nesterov momentum, lr 0.7, momentum 0.9; ``"sgd"``: plain SGD, lr 1, no momentum, i.e. parameter averaging)
with ``outer_lr`` / ``outer_momentum``, or from code as a callable ``params -> torch.optim.Optimizer`` of a
``torch.optim`` class (it travels to the ps tasks by name). ``outer_mode``: ``"sync"`` (one outer step per
round from every live worker's change) or ``"async"`` (each worker's change applied on arrival, with the
strategy's ``staleness`` bound). ``compression``: how a change travels (``float32``, ``bf16``, ``int8``, ``int4``,
with error feedback). ``fragments`` (F): the parameters are synchronised in F fragments in turn, one per outer step.
The strategy's ``overlap=True``: a worker reads an outer push's reply after one more inner step, which it computes
while the ps tasks step, and keeps that step's change on top of the new global values (Streaming DiLoCo's overlap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from towers.errors import InvalidArgumentError, user_error

__all__ = ["DiLoCoOptions", "diloco_options", "OUTER_OPTIMIZERS", "COMPRESSIONS", "OUTER_MODES"]

#: Outer optimizers by name: (lr, momentum, nesterov) defaults.
OUTER_OPTIMIZERS: dict[str, tuple[float, float, bool]] = {"nesterov": (0.7, 0.9, True), "sgd": (1.0, 0.0, False)}
#: How a worker's parameter change travels to the ps tasks.
COMPRESSIONS = ("float32", "bf16", "int8", "int4")
#: Outer rounds: every live worker's change averaged into one step, or each applied on arrival.
OUTER_MODES = ("sync", "async")
_KEYS = ("sync_every", "outer_optimizer", "outer_lr", "outer_momentum", "outer_mode", "compression", "fragments")

OuterFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class DiLoCoOptions:
    """DiLoCo's checked options (see the module's docstring); ``build_outer`` makes the outer optimizer."""

    sync_every: int = 8
    outer_optimizer: str | OuterFactory = "nesterov"
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer_mode: str = "sync"
    compression: str = "float32"
    fragments: int = 1
    #: The strategy's ``overlap``: an outer push's reply is read after the next inner step (computed meanwhile).
    overlap: bool = False

    def __post_init__(self) -> None:
        for name in ("sync_every", "fragments"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise user_error(f"{name} must be a positive integer", f"{name}={value!r}",
                                 f"Pass e.g. {name}={8 if name == 'sync_every' else 2} "
                                 f"(--strategy-option {name}={8 if name == 'sync_every' else 2}).")
        outer = self.outer_optimizer
        if isinstance(outer, str) and outer.lower() not in OUTER_OPTIMIZERS:
            raise user_error(f"outer_optimizer must be one of {tuple(OUTER_OPTIMIZERS)} or a callable params -> "
                             "torch.optim.Optimizer", f"outer_optimizer={outer!r}",
                             "Use 'nesterov' (DiLoCo's default) or 'sgd' (averaging), with outer_lr and "
                             "outer_momentum to change their rates.")
        if not isinstance(outer, str) and not callable(outer):
            raise user_error("outer_optimizer must be a name or a callable params -> torch.optim.Optimizer",
                             f"a {type(outer).__name__}", "Pass outer_optimizer='nesterov', or e.g. "
                             "outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True).")
        if not isinstance(outer, str) and (self.outer_lr is not None or self.outer_momentum is not None):
            raise user_error("outer_lr and outer_momentum set the rates of a named outer optimizer; a callable "
                             "sets its own", f"outer_lr={self.outer_lr!r}, outer_momentum={self.outer_momentum!r}",
                             "Put the rates in the optimizer your callable builds, or drop them.")
        for name, low, high in (("outer_lr", 0.0, None), ("outer_momentum", 0.0, 1.0)):
            value = getattr(self, name)
            if value is None:
                continue
            bad = isinstance(value, bool) or not isinstance(value, (int, float))
            if bad or value < low or (high is not None and value >= high) or (name == "outer_lr" and value == 0):
                span = "> 0" if high is None else f"in [{low:g}, {high:g})"
                raise user_error(f"{name} must be a number {span}", f"{name}={value!r}",
                                 f"Pass e.g. {name}={0.7 if name == 'outer_lr' else 0.9}.")
        if isinstance(outer, str) and outer.lower() == "nesterov" and self.outer_momentum == 0:
            raise user_error("Nesterov momentum needs a momentum > 0", "outer_optimizer='nesterov', outer_momentum=0",
                             "Use outer_optimizer='sgd' for no momentum, or a momentum such as 0.9.")
        if self.outer_mode not in OUTER_MODES:
            raise user_error(f"outer_mode must be one of {OUTER_MODES}", f"outer_mode={self.outer_mode!r}",
                             "Use 'sync' (every worker's change averaged into one outer step) or 'async'.")
        if self.compression not in COMPRESSIONS:
            raise user_error(f"compression must be one of {COMPRESSIONS} (what the ps links carry)",
                             f"compression={self.compression!r}",
                             "Use 'bf16' (half the bytes), 'int8' (a quarter) or 'int4' (an eighth), with error "
                             "feedback.")

    def build_outer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """Return the outer optimizer over ``params`` (the worker sends its class and rates to the ps tasks).

        Raises:
            TypeError: a callable that does not return a ``torch.optim.Optimizer``.
        """
        if not isinstance(self.outer_optimizer, str):
            built = self.outer_optimizer(params)
            if not isinstance(built, torch.optim.Optimizer):
                raise user_error("outer_optimizer must return a torch.optim.Optimizer", f"a {type(built).__name__}",
                                 "Return e.g. torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True).",
                                 cls=TypeError)
            return built
        lr, momentum, nesterov = OUTER_OPTIMIZERS[self.outer_optimizer.lower()]
        lr = lr if self.outer_lr is None else float(self.outer_lr)
        momentum = momentum if self.outer_momentum is None else float(self.outer_momentum)
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)


def diloco_options(mode: str, staleness: int | None, *, overlap: bool, strategy: str,
                   options: dict[str, Any]) -> DiLoCoOptions | None:
    """Return the checked DiLoCo options for ``mode="diloco"``, else None (and no DiLoCo option may be given).

    ``options``: DiLoCo's options by name; None values take the default.

    Raises:
        ValueError: a DiLoCo option without ``mode="diloco"``, a bad value, staleness with sync outer rounds,
            overlap, or ``mode="diloco"`` under a strategy other than ``ps``.
        TypeError: an option DiLoCo does not have.
    """
    options = {key: value for key, value in options.items() if value is not None}  # None: DiLoCo's default
    unknown = sorted(set(options) - set(_KEYS))
    if unknown:
        raise user_error(f"{strategy} got unexpected option(s) {unknown}", sorted(options),
                         f"DiLoCo's options (mode='diloco') are {', '.join(_KEYS)}.", cls=TypeError)
    if mode != "diloco":
        if options:
            raise user_error(f"{', '.join(sorted(options))} are DiLoCo's options", f"mode={mode!r}",
                             "Pass mode='diloco' (--strategy-option mode=diloco) to use them, or leave them out.")
        return None
    if strategy != "ps":
        raise InvalidArgumentError(f"mode='diloco' runs under ParameterServerStrategy (--strategy ps), whose ps tasks "
                                   f"hold the outer optimizer. Received: strategy {strategy!r}. Use --strategy ps.")
    checked = DiLoCoOptions(**options, overlap=overlap)
    if staleness is not None and checked.outer_mode == "sync":
        raise user_error("staleness bounds async outer rounds; sync outer rounds are never stale",
                         f"staleness={staleness} with outer_mode='sync'",
                         "Drop staleness, or pass outer_mode='async' to apply each worker's change on arrival.")
    return checked
