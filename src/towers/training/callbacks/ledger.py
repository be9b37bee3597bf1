"""``ExampleLedger``: append which examples each committed training step trained to the run's ledger (``towers.ledger``)."""

from __future__ import annotations

import os
from typing import Any, Mapping

from towers._logging import get_logger
from towers.ledger.record import LedgerWriter
from towers.training.callbacks.base import Callback

__all__ = ["ExampleLedger"]

log = get_logger(__name__)


class ExampleLedger(Callback):
    """Record, on every rank, the positions of the epoch's example order that each committed step trained.

    The Trainer adds one itself when the job keeps a ledger (``TOWERS_LEDGER_DIR``, or ``towers launch
    --ledger DIR``); pass one to ``fit(callbacks=...)`` to choose the directory in code. Each process
    appends to ``<run_dir>/ledger/rank<r>-<pid>.tsv``; ``towers verify --ledger <run_dir>`` proves from
    them that each example of each completed epoch was trained exactly once.

    A step is recorded after it committed (a fault-tolerant step that did not commit never reaches the
    callbacks). Where a batch names the other replicas' shares of its update (``BatchInfo.peer_rows``:
    replica groups that can be lost after their share entered the committed update, before they wrote
    their own line), they are recorded too, as seen (``W`` lines), so the live replicas' lines prove
    them. At the start of ``fit`` the position the job goes on from is recorded, so that a restore
    from a checkpoint rolls back the steps trained after that checkpoint. Under parameter servers ps
    task 0 records the shares whose gradients it applied, and the workers only the positions they go
    on from. A stream's batches are not recorded (their positions are not an order the ledger can map).

    Args:
        run_dir: the run's folder; the ledger goes to ``<run_dir>/ledger/``.
    """

    def __init__(self, run_dir: str | os.PathLike[str]):
        super().__init__()
        self.run_dir = os.fspath(run_dir)
        self._writer: LedgerWriter | None = None
        self._went_on = False
        self._said_stream = False

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        if not self.attached:
            return
        info = self.trainer.strategy.process_info
        self._writer = LedgerWriter(self.run_dir, f"rank{info.rank}", rank=info.rank, world_size=info.world_size)
        self._went_on = False

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._writer is None or self._went_on:
            return
        self._went_on = True  # the position this fit starts (or resumes) at: the job's history goes on from it
        p = self.trainer.progress
        # A replica group that joined a running job (its input moved it to the job's step) rolls nothing back.
        self._writer.went_on(p.epoch, p.step * p.global_batch_size, "join" if self.trainer.joined_job else "restore")

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._writer is None:
            return
        info = self.trainer.step_batch_info
        if info is None or info.unit is not None:
            return  # not from distribute_dataset, or a parameter server's unit (ps task 0 records those)
        order = getattr(self.trainer.train_input, "ledger_order", None)
        if info.rows is None or order is None:
            if not self._said_stream:
                self._said_stream = True
                log.warning("the ledger does not record this input's batches (a stream, or an input without an "
                            "example order): towers verify --ledger will not see them")
            return
        self._writer.order(order())
        lo, hi = info.rows
        step = int((logs or {}).get("global_step", 0))
        self._writer.update(step, info.epoch, info.index, lo, hi)
        for peer_lo, peer_hi in info.peer_rows:  # the other replicas' shares this commit proves (fault tolerance)
            self._writer.witnessed(step, info.epoch, info.index, peer_lo, peer_hi)

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        if self._writer is not None:
            self._writer.close()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the run directory and the update lines this process wrote so far."""
        return {"run_dir": self.run_dir, "records": self._writer.records if self._writer is not None else 0}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Note the ledger a restored checkpoint was saved with (the restore itself is recorded as fit starts)."""
        if state.get("run_dir") not in (None, self.run_dir):
            log.warning("this checkpoint was saved by a job whose ledger was in %s; this run's goes to %s: "
                        "towers verify --ledger needs both directories' files together", state.get("run_dir"),
                        self.run_dir)
