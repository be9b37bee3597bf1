"""Where FSDP2 is applied: the sharding policy, the device mesh and ``fully_shard`` per unit — in one place.

``shard_model`` is the only function that calls ``fully_shard``. It shards the units the
policy picks, bottom-up, then the root (which keeps whatever the units left: embeddings,
heads, norms), and makes every unit's gradient reduction a SUM. Why a sum: towers' losses are
already divided by the GLOBAL batch size (``compute_average_loss``), so the sum of the
replicas' gradients is one device's gradient of the global batch; FSDP2 would otherwise
divide by the number of replicas a second time (it averages by default).

The mesh is 1-D (every rank holds a 1/N shard) or, for HSDP, 2-D ``(replicate, shard)``:
shards within a group of ``shard_group_size`` ranks (a node), replicas across groups, so the
all-gathers stay on the fast intra-node links and only the gradient all-reduce crosses nodes.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence, Union

import torch
from torch import nn

from towers._logging import get_logger
from towers.errors import InvalidArgumentError
from towers.parallel.blocks import describe_blocks, repeated_blocks
from towers.parallel.layout import Layout

__all__ = ["ShardUnits", "DEFAULT_MIN_NUM_PARAMS", "select_units", "build_mesh",
           "mixed_precision_policy", "shard_model", "fsdp_modules", "broadcast_from_first"]

log = get_logger(__name__)

#: What ``shard_units`` accepts: ``"auto"``, a module class (or a tuple of classes), or a parameter count.
ShardUnits = Union[str, type, Sequence[type], int]

#: The size policy's threshold when ``"auto"`` finds no repeated blocks.
DEFAULT_MIN_NUM_PARAMS = 1_000_000


def _by_size(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """Post-order: a module is a unit when it holds ``min_num_params`` parameters not already in a unit below it."""
    units: list[nn.Module] = []
    taken: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model:
            return
        free = sum(p.numel() for p in module.parameters() if id(p) not in taken)
        if free >= min_num_params:
            units.append(module)
            taken.update(id(p) for p in module.parameters())

    visit(model)
    return units


def select_units(model: nn.Module, shard_units: ShardUnits = "auto") -> list[nn.Module]:
    """Return the submodules to shard as their own FSDP units, children before parents (the root excluded).

    ``"auto"``: the repeated blocks of the model: children of one class repeated (at least twice)
    in an ``nn.ModuleList``, ``nn.ModuleDict`` (torchtitan's Llama) or ``nn.Sequential`` (there,
    modules with submodules of their own) — the transformer blocks of a GPT, Llama, ViT or BERT;
    the units chosen are logged at INFO. A model without any falls back to the size policy at
    ``DEFAULT_MIN_NUM_PARAMS``, with a warning naming the fix (at INFO for a model smaller than that,
    which is one unit under any policy). A class or tuple of classes: every
    instance. An int: the size policy (a module holding that many parameters not yet in a unit).

    Raises:
        ValueError: on any other value, or a non-positive parameter count.
    """
    if isinstance(shard_units, str):
        if shard_units != "auto":
            raise InvalidArgumentError(
                f"shard_units must be 'auto', a module class (or tuple of classes) or a parameter count. "
                f"Received: {shard_units!r}. Example: shard_units=MyBlock or shard_units=1_000_000.")
        blocks = repeated_blocks(model)
        if blocks:
            log.info("shard_units='auto': sharding %s + the root", describe_blocks(blocks))
            return blocks
        units = _by_size(model, DEFAULT_MIN_NUM_PARAMS)
        chosen = f"{describe_blocks(units)} of >= {DEFAULT_MIN_NUM_PARAMS:,} parameters + the root" if units else (
            "the whole model as one unit")
        size = sum(p.numel() for p in model.parameters())
        # Below the size policy's threshold one unit is what any policy gives: nothing to fix, so no warning.
        log.log(logging.WARNING if size >= DEFAULT_MIN_NUM_PARAMS else logging.INFO,
                "shard_units='auto' found no repeated blocks in %s (children of one class repeated in an "
                "nn.ModuleList, nn.ModuleDict or nn.Sequential), so it shards its %s parameters by size: %s. Pass "
                "your block class (shard_units=MyBlock) or a parameter count (shard_units=10_000_000).",
                type(model).__name__, f"{size:,}", chosen)
        return units
    if isinstance(shard_units, int) and not isinstance(shard_units, bool):
        if shard_units < 1:
            raise InvalidArgumentError(f"shard_units as a parameter count must be >= 1. Received: {shard_units}.")
        return _by_size(model, shard_units)
    classes = (shard_units,) if isinstance(shard_units, type) else tuple(shard_units)  # type: ignore[arg-type]
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise InvalidArgumentError(
            f"shard_units must be 'auto', an nn.Module subclass (or tuple of them) or a parameter count. "
            f"Received: {shard_units!r}.")
    ordered: list[nn.Module] = []

    def visit(module: nn.Module) -> None:  # post-order, so nested units are sharded before their parents
        for child in module.children():
            visit(child)
        if module is not model and isinstance(module, classes) and any(True for _ in module.parameters()):
            ordered.append(module)

    visit(model)
    return ordered


def build_mesh(world_size: int, device_type: str, shard_group_size: int | None = None) -> Any:
    """Return the data-parallel ``DeviceMesh`` FSDP2 shards over: 1-D over ``world_size`` ranks, or 2-D
    ``(dp_replicate, dp_shard)`` for HSDP (``towers.parallel.layout``, the one place a mesh is built).

    Raises:
        ValueError: when ``shard_group_size`` does not divide ``world_size``.
    """
    return Layout.from_spec(None, world_size, shard_group_size=shard_group_size).build(device_type).fsdp


def mixed_precision_policy(precision: str, *, root: bool = True) -> Any:
    """Return FSDP2's ``MixedPrecisionPolicy`` for towers' precision name: parameters in bf16/fp16, reductions in fp32.

    The root's outputs are cast back to float32, so losses are computed in full precision as under the
    other strategies. A unit's (``root=False``) stay in the compute dtype: the root's own layers after it
    (a final norm, a head) compute in that dtype, and a float32 input would not match their weights.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                output_dtype=torch.float32 if root else None)


def shard_model(model: nn.Module, mesh: Any, *, shard_units: ShardUnits = "auto",
                reshard_after_forward: bool = True, precision: str = "32", cpu_offload: bool = False) -> nn.Module:
    """Apply ``fully_shard`` to each unit ``select_units`` picks, then to the root; return the (same) root module.

    Every unit reduces gradients with a SUM (no division by the number of replicas).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    units = select_units(model, shard_units)
    options: dict[str, Any] = {
        "mesh": mesh,
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy(),
    }
    for unit in units:
        fully_shard(unit, reshard_after_forward=reshard_after_forward,
                    mp_policy=mixed_precision_policy(precision, root=False), **options)
    # The root's parameters are needed first in backward: keep them gathered after forward (FSDP2's own default).
    fully_shard(model, reshard_after_forward=False if units else reshard_after_forward,
                mp_policy=mixed_precision_policy(precision), **options)
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)  # SUM: see the module docstring
        module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (no PREMUL_SUM, which Gloo lacks)
    log.debug("fully_shard: %d unit(s) + root on mesh %s (reshard_after_forward=%s, precision=%s, cpu_offload=%s)",
              len(units), tuple(mesh.shape), reshard_after_forward, precision, cpu_offload)
    return model


def broadcast_from_first(model: nn.Module, group: Any = None) -> None:
    """Give every process the job's first process's parameters and buffers (as DDP does, however the script seeded);
    ``group``: among its processes only (the job's first must be one of them)."""
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0, group=group)


def fsdp_modules(model: nn.Module) -> list[Any]:
    """Return every FSDP-sharded module in ``model`` (root included)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]
