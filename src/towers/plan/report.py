"""The ``towers plan`` table: one row per kind of memory, one column per replica count."""

from __future__ import annotations

from typing import Sequence

from towers.plan.estimate import LayoutEstimate, MemoryEstimate

__all__ = ["format_bytes", "format_table", "format_layout_table"]

_ROWS = (
    ("parameters", "parameters (+ buffers)"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer state"),
    ("activations", "activations (estimate)"),
    ("gathered_parameters", "gathered parameters"),
    ("communication", "communication buffers"),
    ("optimizer_temporaries", "optimizer step temporaries"),
    ("peak", "peak"),
)


def format_bytes(n: int) -> str:
    """Return ``n`` bytes in binary units: ``"512 B"``, ``"1.5 KiB"``, ``"42.7 MiB"``, ``"3.05 GiB"``.

    Args:
        n: a number of bytes.

    Returns:
        ``n`` in the largest binary unit it reaches, to about three significant digits.
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.{2 if unit == 'GiB' else 1}f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - the loop returns


def format_table(estimates: Sequence[MemoryEstimate], *, model_name: str = "model") -> str:
    """Return the per-replica table of ``estimates`` (one strategy, batch, precision and optimizer; several replica counts).

    Args:
        estimates: what ``estimate_memory_table`` returned.
        model_name: the model's name in the title.

    Returns:
        The table ``towers plan`` prints.
    """
    first = estimates[0]
    head = (f"{model_name}: {first.num_parameters:,} parameters; {first.strategy}, batch {first.batch_size} per "
            f"replica, precision {first.precision}, optimizer {first.optimizer}")
    columns = [f"{e.replicas} replica" + ("s" if e.replicas != 1 else "") for e in estimates]
    lines = [head, "", *_grid("per replica", columns, estimates)]
    notes = []
    if first.strategy == "mirrored":
        notes.append("From 2 replicas on, DDP's all-reduce buckets are the gradients themselves (no extra copy).")
    else:
        notes.append("Sharded: parameters, gradients and optimizer state split over the replicas; gathered parameters "
                     "are the root's own and two units' at once, in the compute dtype.")
    notes.append("The peak counts tensors: add what your data set keeps in memory and the process itself (Python, "
                 "torch, a CUDA context).")
    return "\n".join(lines + [""] + notes)


def _grid(corner: str, columns: list[str], estimates: Sequence[MemoryEstimate]) -> list[str]:
    """The table's lines: a header of ``columns`` under ``corner``, then one row of bytes per field of ``_ROWS``."""
    width = max(len(text) for _, text in _ROWS)
    cells = [[format_bytes(getattr(e, name)) for e in estimates] for name, _ in _ROWS]
    col = max(max(len(c) for c in columns), *(len(c) for row in cells for c in row))
    lines = [corner.ljust(width) + "".join(f"  {c:>{col}}" for c in columns)]
    for (_, text), row in zip(_ROWS, cells):
        lines.append(text.ljust(width) + "".join(f"  {c:>{col}}" for c in row))
    return lines


def format_layout_table(estimate: LayoutEstimate, *, model_name: str = "model") -> str:
    """Return the per-rank table of a ``LayoutEstimate``: one column per pipeline stage position (its ranks).

    Args:
        estimate: what ``estimate_layout`` returned.
        model_name: the model's name in the title.

    Returns:
        The table ``towers plan --mesh`` prints.
    """
    stages = estimate.stages
    first, layout = stages[0], estimate.layout
    head = (f"{model_name}: {first.num_parameters:,} parameters; {estimate.strategy} on mesh {layout.describe()} "
            f"({layout.world_size} processes), batch {first.batch_size} per replica, precision {first.precision}, "
            f"optimizer {first.optimizer}")

    def label(e: MemoryEstimate) -> str:
        ranks = f"rank {e.ranks[0]}" if len(e.ranks) == 1 else f"ranks {e.ranks[0]}-{e.ranks[-1]}"
        return f"{ranks} (stage {e.stage})" if layout.pp > 1 else ranks

    lines = [head, "", *_grid("per rank", [label(e) for e in stages], stages)]
    notes = []
    if layout.tp > 1:
        notes.append(f"tp={layout.tp}: the layers the model's tensor-parallel plan splits hold 1/{layout.tp} of their "
                     "weights and activations on each rank; the rest is replicated.")
    if layout.pp > 1:
        flights = ", ".join(f"stage {e.stage}: {e.microbatches_in_flight}" for e in stages)
        notes.append(f"pp={layout.pp}: each rank holds its stage's modules; 1F1B keeps micro-batches in flight "
                     f"({flights}).")
    if first.strategy == "sharded":
        notes.append(f"Sharded: parameters, gradients and optimizer state split over dp_shard={layout.dp_shard}; "
                     "gathered parameters are the root's own and two units' at once, in the compute dtype.")
    else:
        notes.append("Mirrored: every replica holds its whole share of the model (dp does not divide it); DDP's "
                     "buckets are the gradients.")
    notes.append(f"Job peak (the largest rank): {format_bytes(estimate.peak)}. The peak counts tensors: add what your "
                 "data set keeps in memory and the process itself (Python, torch, a CUDA context).")
    return "\n".join(lines + [""] + notes)
