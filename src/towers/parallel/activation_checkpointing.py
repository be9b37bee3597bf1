"""``prepare(..., activation_checkpointing=)``: recompute each repeated block's activations in backward instead of
keeping them.

``"block"``: every repeated block of the model (the blocks ``shard_units="auto"`` finds: a GPT's or
Llama's transformer blocks) keeps only its input; backward runs its forward again to get the rest.
The least memory, about one more forward of compute per step.

``"selective"``: torchtitan's op-level selective checkpointing: inside each block the outputs of
the matmuls and of attention (``SAVED_OPS``, the costly ops) are kept and only the cheap ops
(norms, activations, residual adds, dropout) are recomputed. Less memory than ``"off"``, more than
``"block"``, and almost no extra compute. (torchtitan also recomputes every second matmul; here
every matmul is kept, so the recomputation is only ever elementwise.)

Both apply before the strategy wraps the model (DDP, FSDP2) and before ``torch.compile``, as
torchtitan does, and keep every parameter name and ``state_dict`` key: the block's own forward is
replaced by one that runs it under ``torch.utils.checkpoint`` (non-reentrant, random state kept, so
dropout draws the same mask again), instead of wrapping the block in a module that would add
``_checkpoint_wrapped_module.`` to its names. A checkpoint therefore loads with the option on or off. Module
hooks on a block (FSDP2's gathers) stay outside the recomputation. While gradients are on, a block is
given no key/value cache (Hugging Face's ``use_cache``, ``cache``, ``past_key_values``): its recomputation
would write the cache a second time. Hugging Face's own gradient checkpointing does the same.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from towers._logging import get_logger
from towers.errors import InvalidArgumentError
from towers.parallel.blocks import describe_blocks, repeated_blocks

__all__ = ["ACTIVATION_CHECKPOINTING", "SAVED_OPS", "check_activation_checkpointing", "apply_activation_checkpointing",
           "checkpointed_blocks"]

log = get_logger(__name__)

#: The values ``activation_checkpointing`` takes.
ACTIVATION_CHECKPOINTING = ("off", "block", "selective")


def _ops(*names: str) -> frozenset[Any]:
    """The named ``torch.ops`` overloads that this build of torch has (attention kernels differ by version)."""
    found = []
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(getattr(packet, overload))
    return frozenset(found)


#: What ``"selective"`` keeps: matmuls, every attention kernel, the sharded gradient's reduce-scatter, and ``max``
#: (a low-precision recipe's scale); all else inside a block is recomputed in backward.
SAVED_OPS = _ops(
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten._scaled_dot_product_efficient_attention.default", "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "_c10d_functional.reduce_scatter_tensor.default", "aten.max.default",
)


def check_activation_checkpointing(value: object) -> str:
    """Return ``value`` when it is one of ``ACTIVATION_CHECKPOINTING``.

    Raises:
        InvalidArgumentError: naming the value received and the three choices.
    """
    if not isinstance(value, str) or value not in ACTIVATION_CHECKPOINTING:
        raise InvalidArgumentError(
            f"activation_checkpointing must be one of {', '.join(map(repr, ACTIVATION_CHECKPOINTING))}. "
            f"Received: {value!r}. Use 'block' (least memory: each repeated block is recomputed in backward), "
            "'selective' (matmul and attention outputs kept, the cheap ops recomputed) or 'off'.")
    return value


def _selective_contexts() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(list(SAVED_OPS))


#: A block's key/value cache arguments (Hugging Face's names over the versions): a recomputed block would write its
#: cache a second time in backward, so under checkpointing the cache is left out, as Hugging Face's own does.
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _run_checkpointed(forward: Callable[..., Any], selective: bool, *args: Any, **kwargs: Any) -> Any:
    """A block's forward under ``torch.utils.checkpoint`` (what ``apply_activation_checkpointing`` installs).

    Without gradients (evaluation, generation) nothing is recomputed: the forward runs as it is, cache included.
    """
    from torch.utils.checkpoint import checkpoint

    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    for name in _CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            kwargs[name] = None
    if selective:  # the policy named here, not passed in: torch.compile traces only a context_fn it can see
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _installed(block: nn.Module) -> functools.partial | None:
    forward = block.__dict__.get("forward")
    return forward if isinstance(forward, functools.partial) and forward.func is _run_checkpointed else None


def checkpointed_blocks(model: nn.Module) -> list[nn.Module]:
    """Return the submodules of ``model`` whose forward ``apply_activation_checkpointing`` runs under a checkpoint."""
    return [m for m in model.modules() if _installed(m) is not None]


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Make each repeated block of ``model`` recompute its activations in backward, as ``mode`` says; return ``model``.

    In place, and before any wrapping: the blocks' forwards are replaced (names and ``state_dict`` keys
    do not change). ``"off"`` leaves the model as it is.

    Raises:
        InvalidArgumentError: ``mode`` is not one of ``ACTIVATION_CHECKPOINTING``, or the model has no repeated
            blocks (the message names the model's class and what to do).
    """
    mode = check_activation_checkpointing(mode)
    if mode == "off":
        return model
    blocks = repeated_blocks(model)
    if not blocks:
        raise InvalidArgumentError(
            f"activation_checkpointing={mode!r} recomputes the repeated blocks of a model (children of one class "
            f"repeated in an nn.ModuleList, nn.ModuleDict or nn.Sequential, such as a transformer's layers), and "
            f"{type(model).__name__} has none. Received: a {type(model).__name__} with "
            f"{sum(p.numel() for p in model.parameters()):,} parameters. Keep its layers in an nn.ModuleList (or "
            "nn.ModuleDict / nn.Sequential of blocks), wrap the part to recompute with torch.utils.checkpoint "
            "yourself, or pass activation_checkpointing='off'.")
    for block in blocks:
        installed = _installed(block)  # prepared again (another strategy, another mode): the block's own forward
        forward = installed.args[0] if installed is not None else block.forward
        # A partial over the bound forward (not a closure): copy.deepcopy of the model rebinds it to the copy.
        block.forward = functools.partial(_run_checkpointed, forward, mode == "selective")  # type: ignore[method-assign]
    log.info("activation_checkpointing=%r: %s of %s recomputed in backward", mode,
             describe_blocks(blocks, "block"), type(model).__name__)
    return model
