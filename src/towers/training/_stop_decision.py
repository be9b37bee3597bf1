"""Whether training stops: a flag a callback may set on one replica, decided for all of them at once."""

from __future__ import annotations

import torch

from towers._logging import get_logger
from towers.strategies.base import PeerLostError, Strategy

__all__ = ["StopDecision"]

log = get_logger(__name__)


class StopDecision:
    """The global decision to stop training (one small collective), and a stop not yet decided."""

    def __init__(self, strategy: Strategy):
        self.strategy = strategy
        self.pending = False  # a stop whose reduction failed (a lost peer): decided at the next one

    def reset(self) -> None:
        """A fit starts: no stop pending."""
        self.pending = False

    def any_replica(self, flag: bool, global_step: int) -> bool:
        """True when ``flag`` is set on any replica: a callback may decide on one replica only, and stopping must
        still be a global decision. When a peer was lost since the step began (``PeerLostError``), nobody
        decides now: False, and this replica's flag joins the next reduction."""
        flag = flag or self.pending
        try:
            decided = self.strategy.reduce("max", torch.tensor([float(flag)], device=self.strategy.device))
        except PeerLostError as exc:
            if flag:
                log.warning("stop_training not decided at global step %d (%s): it is at the next reduction",
                            global_step, str(exc).splitlines()[0])
            self.pending = flag
            return False
        self.pending = False
        return bool(decided.item() > 0)
