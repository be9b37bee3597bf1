"""``bitwise=True``'s set-up: the options checked before any process group, the
deterministic kernels it turns on, the error that names an op without one, and the random draws keyed by the
micro-batch (``_bitwise.py`` holds the tree itself)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from towers.errors import user_error
from towers.strategies._bitwise import BitwiseSteps

__all__ = ["keyed_random", "deterministic_kernels", "named_kernel_error", "bitwise_steps"]


@contextlib.contextmanager
def keyed_random(device: torch.device, key: tuple[int, int, int]) -> Iterator[None]:
    """Within: torch's random generators seeded from ``key`` (epoch, global batch, global micro-batch), so a dropout
    mask is the micro-batch's, whichever replica computes it; the caller's random state is restored after."""
    epoch, batch, leaf = key
    seed = ((epoch * 1_000_003 + batch) * 1_000_003 + leaf) % (2 ** 63)
    devices = [device.index if device.index is not None else 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield

def deterministic_kernels(device: torch.device) -> None:
    """Turn on torch's deterministic kernels for the process (``bitwise=True`` asks for the same bits every run): an op
    without one then raises at its first call (``named_kernel_error`` names it); on a GPU cuBLAS gets the fixed
    workspace it needs for that (``CUBLAS_WORKSPACE_CONFIG``, unless set already)."""
    import os

    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    # Not NaN-filling every new tensor (torch's kernels write what they later read): the fill is one more pass over
    # memory per allocation, 0.4 s of a 69.5M GPT's 3.3 s bitwise step on 2 CPU replicas.
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]

def named_kernel_error(exc: RuntimeError) -> Exception | None:
    """The error to raise for torch's "no deterministic implementation" ``exc`` (None for another error)."""
    text = str(exc)
    if "does not have a deterministic implementation" not in text:
        return None
    op = text.split(" does not have a deterministic implementation")[0].strip()
    return user_error("bitwise=True runs with torch.use_deterministic_algorithms(True), and an op of the step has no "
                      "deterministic kernel on this device", op,
                      "Replace that op with one that has (e.g. index_add_ / scatter_add_ for a histogram, a dense "
                      "update for a sparse one), compute it on the CPU, or turn bitwise off (same maths within "
                      "rounding).")

def bitwise_steps(bitwise: Any, micro_batch_size: Any, *, strategy: str, precision: str,
                  refused: str | None = None) -> Callable[..., BitwiseSteps] | None:
    """Check ``bitwise=`` and ``micro_batch_size=`` before any process group; return how to build the ``BitwiseSteps``
    once the replicas are known (``build(rank, num_replicas, gather, group=None)``), or None when bitwise is off.

    Raises:
        ValueError: a micro-batch size that is not a positive integer, or an option bitwise cannot keep exact
            (``refused``: the strategy's own reason, e.g. a tensor-parallel mesh).
    """
    from towers.cluster.strategy_options import parse_flag

    if not parse_flag("bitwise", bitwise):
        return None
    if isinstance(micro_batch_size, str) and micro_batch_size.strip().isdigit():
        micro_batch_size = int(micro_batch_size)
    if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int)
                                         or micro_batch_size < 1):
        raise user_error("micro_batch_size is the examples of one micro-batch under bitwise=True, the unit whose "
                         "gradient is the same at every replica count", f"micro_batch_size={micro_batch_size!r}",
                         "Pass a positive integer m (--strategy-option micro_batch_size=m) dividing the global batch, "
                         "e.g. B/12 for equal shares at 1, 2, 3 and 4 replicas, or leave it out (B/12 where it divides).")
    for bad, why in ((refused, refused), (precision != "32", f"precision={precision!r}: autocast kernels")):
        if bad:
            raise user_error(f"{strategy}(bitwise=True) cannot keep this exact", str(why),
                             "Leave it out with bitwise=True (precision='32'), or turn bitwise off.")
    size = micro_batch_size

    def build(rank: int, num_replicas: int, gather: Callable[[torch.Tensor], torch.Tensor], group: Any = None,
              exchange: Callable[[torch.Tensor], torch.Tensor] | None = None, lockstep: bool = False,
              deliver: Callable[..., None] | None = None) -> BitwiseSteps:
        return BitwiseSteps(size, rank=rank, num_replicas=num_replicas, gather=gather, group=group, exchange=exchange,
                            lockstep=lockstep, deliver=deliver)

    return build
