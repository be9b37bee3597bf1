"""Model FLOPs of a training step, counted by torch's ``FlopCounterMode``, and the shape of a batch.

``count_flops(fn)`` runs ``fn`` (a forward and backward: one training step) and returns its result and the FLOPs of
the matrix products torch counts in it (matmuls, convolutions, attention; forward and backward),
the "model FLOPs" of MFU. Element-wise work (activations, norms, the optimizer) is not counted, and
a causal attention counts its full square, as the usual 6N + 12·L·d·T formula does.

``batch_shape(batch)`` reads the rows and, for a token model, the tokens of a batch as towers feeds
models: ``(x, y)`` tuples, dicts passed as keyword arguments, a tensor. Tokens are the elements of
an integer ``input_ids`` (a dict batch) or of an integer ``[batch, sequence]`` input (nanoGPT's
``(idx, targets)``), padding included: the model computes on them.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, TypeVar

import torch

__all__ = ["count_flops", "counting_flops", "FlopTally", "BatchShape", "batch_shape"]

T = TypeVar("T")


@dataclass
class FlopTally:
    """What ``counting_flops`` counted: ``total`` FLOPs, set when its block ends without an error (0 until then)."""

    total: int = 0


@contextlib.contextmanager
def counting_flops() -> Iterator[FlopTally]:
    """Count the model FLOPs of the block's torch operations (``torch.utils.flop_counter.FlopCounterMode``).

    Put one real step in the block (the model's forward and ``backward``): the tally is the forward's
    and the backward's matrix products (a backward ~2x its forward), for this process's batch.
    """
    from torch.utils.flop_counter import FlopCounterMode

    _count_cpu_attention()
    tally = FlopTally()
    with warnings.catch_warnings(), _eager():
        # The counter tracks modules with global hooks; a model compiled inside the step warns that they fire twice.
        warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")
        counter = FlopCounterMode(display=False)
        counter.mod_tracker = _GlobalOnly()  # type: ignore[assignment]
        with counter:
            yield tally
    tally.total = int(counter.get_total_flops())


class _GlobalOnly:
    """The module tracker ``FlopCounterMode`` consults, reduced to the total towers reads ("Global").

    torch's own tracker hooks every module input's gradient (a multi-grad hook), which breaks an
    ``autograd.grad`` on a leaf input inside the counted step: a pipeline stage's first step runs one."""

    parents = frozenset({"Global"})

    def __enter__(self) -> "_GlobalOnly":
        return self

    def __exit__(self, *args: object) -> None:
        return None


def _eager() -> contextlib.AbstractContextManager[Any]:
    """Compiled code runs eagerly in the counted step: a compiled kernel is invisible to the counter, and a frame
    that Dynamo first meets under a dispatch mode is never compiled (seen on torch 2.13); later steps compile."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def count_flops(fn: Callable[[], T]) -> tuple[T, int]:
    """Return ``fn()`` and the model FLOPs counted while it ran (``counting_flops`` around one call)."""
    with counting_flops() as tally:
        result = fn()
    return result, tally.total


def _attention_flops(query: Any, key: Any, value: Any) -> int:
    """Q @ K^T and P @ V of an attention call, the full square (``[batch, heads, seq, head_dim]`` shapes)."""
    b, h, s_q, d_q = query
    s_k, d_v = key[2], value[3]
    return 2 * b * h * s_q * s_k * (d_q + d_v)


def _count_cpu_attention() -> None:
    """Teach the counter the CPU's fused attention, which torch counts on GPUs only (torch 2.13): a forward as
    ``_attention_flops``, a backward twice that (dV, dP, dQ, dK), as torch counts its GPU kernels."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is not None and forward not in flop_registry:
        register_flop_formula(forward)(lambda q, k, v, *args, out_shape=None, **kwargs: _attention_flops(q, k, v))
    if backward is not None and backward not in flop_registry:
        register_flop_formula(backward)(
            lambda grad, q, k, v, *args, out_shape=None, **kwargs: 2 * _attention_flops(q, k, v))


@dataclass(frozen=True)
class BatchShape:
    """A batch's ``rows`` (examples) and ``tokens`` (None when the model does not take tokens)."""

    rows: int
    tokens: int | None = None


def batch_shape(batch: Any) -> BatchShape:
    """Return the rows and tokens of ``batch``: a tensor, ``(x, y, ...)`` or a dict of tensors (``x`` may be a dict)."""
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor) and _is_integer(ids) and ids.dim() >= 1:
            return BatchShape(len(ids), ids.numel())
        first = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 1), None)
        return BatchShape(len(first) if first is not None else 0)
    if isinstance(batch, torch.Tensor) and batch.dim() >= 1:
        tokens = batch.numel() if batch.dim() == 2 and _is_integer(batch) else None
        return BatchShape(len(batch), tokens)
    return BatchShape(0)


def _is_integer(tensor: torch.Tensor) -> bool:
    return not tensor.dtype.is_floating_point and not tensor.dtype.is_complex and tensor.dtype != torch.bool
