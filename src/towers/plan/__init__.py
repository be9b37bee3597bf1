"""``towers plan``: how much memory one replica needs, before launching the job (``docs/plan.md``)."""

from towers.plan.estimate import STRATEGIES, MemoryEstimate, estimate_memory, estimate_memory_table
from towers.plan.report import format_bytes, format_table

__all__ = ["STRATEGIES", "MemoryEstimate", "estimate_memory", "estimate_memory_table", "format_bytes", "format_table"]
