"""The ledger: which examples each committed update trained, written as the job runs and proved afterwards.

Every rank (or, under parameter servers, ps task 0, which knows when a worker's gradients were applied)
appends one line per committed share of a global batch to its own file under ``<ledger_dir>/ledger/``
(``record.py``); a restore from a checkpoint appends a line saying from which position the job went on.
``towers verify --ledger RUN_DIR`` reads every file (``proof.py``), drops the updates a restore rolled back
and proves that each example of each completed epoch was trained exactly once, or lists what was
missed or doubled, with the step where it happened.
"""

from __future__ import annotations

from towers.ledger.proof import EpochProof, LedgerProof, prove_ledger
from towers.ledger.record import LEDGER_SUBDIR, LedgerWriter, OrderSpec

__all__ = ["LedgerWriter", "OrderSpec", "LEDGER_SUBDIR", "prove_ledger", "LedgerProof", "EpochProof"]
