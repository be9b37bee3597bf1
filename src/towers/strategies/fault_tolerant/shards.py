"""A sharded model's state as a healing replica group receives it (FaultTolerantStrategy with ``shard=True``).

Inside a group of N processes FSDP2 shards the parameters, gradients and optimizer state; process
r of a healing group receives the state of process r of a live group, which holds the same shards.
The state therefore travels as each process's local shards (plain tensors, which the wire format
carries), and is written back into the local shards of the receiving process's DTensors.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from towers.errors import InvalidArgumentError

__all__ = ["local_state", "load_local_model", "load_local_optimizer"]


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_state(value: Any) -> Any:
    """Return ``value`` (a state dict, nested) with every DTensor replaced by this process's local shard."""
    if _is_dtensor(value):
        return value.to_local().detach()
    if isinstance(value, dict):
        return {k: local_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_state(v) for v in value)
    return value


def load_local_model(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (local shards and plain tensors, by state-dict name) into ``model``'s parameters and buffers.

    Raises:
        ValueError: when a name or a shard's shape does not match (the sender shards another model).
    """
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    missing = sorted(set(own) - set(state))
    if missing:
        raise InvalidArgumentError(f"the live group's state lacks {missing[:5]}: every group must run the same model")
    with torch.no_grad():
        for name, target in own.items():
            local = cast(Any, target).to_local() if _is_dtensor(target) else target
            if local.shape != state[name].shape:
                raise InvalidArgumentError(f"{name}: the live group's shard has shape {tuple(state[name].shape)}, this process's "
                                           f"{tuple(local.shape)}: every group must shard the same model over the same processes")
            local.copy_(state[name])


def load_local_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an optimizer state whose per-parameter tensors are local shards: each is wrapped back as a DTensor
    sharded like its parameter before ``optimizer.load_state_dict``."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, per_param in state.get("state", {}).items():
        param = params[int(index)]
        if not _is_dtensor(param):
            continue
        local_shape = param.to_local().shape
        for key, value in list(per_param.items()):
            if isinstance(value, torch.Tensor) and value.dim() and value.shape == local_shape:
                per_param[key] = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                    shape=param.shape, stride=param.stride())
    optimizer.load_state_dict(state)
