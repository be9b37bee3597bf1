"""Save and restore the state of a job, the same way under every strategy and world size.

``save_checkpoint(path, {"model": model, "optimizer": optimizer, "epoch": 3}, strategy=strategy)``
writes a checkpoint directory (``layout.py``): the prepared model's and optimizer's tensors
through ``torch.distributed.checkpoint`` — every process writes its part, nothing is gathered on
one rank — and every other value (modules and objects with ``state_dict()`` as their state dicts,
numbers, strings, tensors) by the chief. ``restore_checkpoint(path, {...}, strategy=strategy)``
reads it under any strategy and any number of processes, resharding where the layout differs,
after checking that every key and shape fits: nothing is ever restored in part.

Optimizer state is keyed by parameter name (``state.py``), so a checkpoint written under
``MirroredStrategy`` restores under ``FullyShardedStrategy``, parameter servers or one process.

The pieces, re-exported here: ``protocol.py`` (``CheckpointStrategy``, the state of a plain
module), ``save.py`` (writing), ``fit.py`` (the checks before a restore), ``restore.py`` (reading).
"""

from towers.checkpoint.fit import check_model_fits
from towers.checkpoint.protocol import (
    CheckpointStrategy,
    load_plain_state_dict,
    plain_state_dict,
    require_optimizer_state,
)
from towers.checkpoint.restore import (
    checkpoint_exists,
    checkpoint_info,
    delete_checkpoint,
    load_checkpoint,
    read_into,
    restore_checkpoint,
)
from towers.checkpoint.save import save_checkpoint, write_checkpoint

__all__ = ["CheckpointStrategy", "save_checkpoint", "write_checkpoint", "load_checkpoint", "restore_checkpoint",
           "checkpoint_info", "checkpoint_exists", "delete_checkpoint", "check_model_fits", "plain_state_dict",
           "load_plain_state_dict", "require_optimizer_state", "read_into"]
