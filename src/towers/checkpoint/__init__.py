"""The state of a job, saved and restored one way under every strategy and world size.

Layers, each file using only those above it:

- ``state.py``: the pieces as plain values (RNG streams, optimizer state by parameter name, paths);
- ``integrity.py``: each file's SHA-256, computed while it is written, checked wherever it is read;
- ``layout.py``: the format on disk (DCP tensor files + the chief's ``state.pt``, published atomically),
  written there; ``files.py`` (where each file lies), ``manifest.py`` (``state.pt`` read back),
  ``dcp_read.py`` (the tensors read through DCP, safely), ``dcp_support.py``, ``checkpoint_io.py``
  (``CheckpointIO``: who writes the tensors);
- ``api.py``: ``save_checkpoint`` / ``load_checkpoint`` / ``restore_checkpoint`` through a strategy, from
  ``protocol.py`` (``CheckpointStrategy``), ``save.py``, ``fit.py`` (checks before a restore), ``restore.py``;
- ``manager.py``: ``CheckpointManager`` (numbered, keep N, latest, preemption);
- ``preemption.py``: a SIGTERM notice -> one agreed step -> a save -> a "restart me" exit;
- ``export.py``: the plain module's full weights for inference.

The Trainer's callbacks (``BackupAndRestore``, ``ModelCheckpoint``) build on these in
``towers.training.callbacks``.
"""

from towers.checkpoint.api import (
    checkpoint_exists,
    checkpoint_info,
    delete_checkpoint,
    load_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from towers.checkpoint.export import export_model, load_exported
from towers.checkpoint.layout import CheckpointIO
from towers.checkpoint.manager import CheckpointManager
from towers.checkpoint.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionHandler
from towers.checkpoint.state import CheckpointError, CorruptCheckpointError, rng_state, set_rng_state

__all__ = [
    "CheckpointError", "CheckpointIO", "CorruptCheckpointError", "CheckpointManager", "PREEMPTED_EXIT_CODE", "Preempted",
    "PreemptionHandler",
    "checkpoint_exists", "checkpoint_info", "delete_checkpoint", "export_model", "load_checkpoint", "load_exported",
    "restore_checkpoint", "rng_state", "save_checkpoint", "set_rng_state",
]
