"""``towers plan``: how much memory each rank needs, before launching the job (``docs/plan.md``)."""

from towers.plan.estimate import (
    MESH_STRATEGIES,
    STRATEGIES,
    LayoutEstimate,
    MemoryEstimate,
    estimate_layout,
    estimate_memory,
    estimate_memory_table,
)
from towers.plan.report import format_bytes, format_layout_table, format_table

__all__ = ["STRATEGIES", "MESH_STRATEGIES", "MemoryEstimate", "LayoutEstimate", "estimate_memory",
           "estimate_memory_table", "estimate_layout", "format_bytes", "format_table", "format_layout_table"]
