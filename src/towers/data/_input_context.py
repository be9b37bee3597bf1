"""What ``distribute_datasets_from_function`` tells an input function (``InputContext``), and the positive-integer check
the input classes share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from towers.errors import user_error

__all__ = ["InputContext", "positive_int"]


def positive_int(name: str, value: Any, hint: str) -> int:
    """Return ``value`` when it is an integer >= 1; otherwise raise the user error naming ``name`` with ``hint``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise user_error(f"{name} must be a positive integer", value, hint)
    return value


@dataclass(frozen=True)
class InputContext:
    """What ``distribute_datasets_from_function`` tells the input function: its pipeline among all (tf.distribute's).

    Attributes:
        num_input_pipelines: the input pipelines of the job (one per process).
        input_pipeline_id: this pipeline's index: the function reads its share of the data by it.
        num_replicas_in_sync: the replicas that split each global batch.
        device: the replica's device (where its batches should end up).

    Example:
        ```python
        import torch
        import towers

        strategy = towers.OneDeviceStrategy("cpu")
        data = torch.utils.data.TensorDataset(torch.arange(32.0))

        def input_fn(context: towers.InputContext):
            batch = context.get_per_replica_batch_size(8)
            mine = torch.utils.data.Subset(data, range(context.input_pipeline_id, len(data), context.num_input_pipelines))
            return torch.utils.data.DataLoader(mine, batch_size=batch)

        batches = list(strategy.distribute_datasets_from_function(input_fn))
        assert len(batches) == 4
        ```
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1
    #: The replica's device (where its batches should end up).
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """Return ``global_batch_size // num_replicas_in_sync``.

        Raises:
            ValueError: when the global batch does not divide evenly over the replicas.
        """
        positive_int("global_batch_size", global_batch_size, "Pass the examples per step over all replicas.")
        if global_batch_size % self.num_replicas_in_sync:
            raise user_error(f"The global batch size must be divisible by the number of replicas "
                             f"({self.num_replicas_in_sync})", global_batch_size,
                             f"Use a multiple of {self.num_replicas_in_sync}, or strategy.distribute_dataset, "
                             "which splits any global batch exactly.")
        return global_batch_size // self.num_replicas_in_sync
