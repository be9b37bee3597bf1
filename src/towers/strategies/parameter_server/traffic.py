"""What a worker sent to and received from the ps tasks: ``ParameterServerStrategy.wire_stats``."""

from __future__ import annotations

from typing import Sequence

from towers.strategies.parameter_server.diloco import DiLoCo
from towers.strategies.parameter_server.embeddings import SparseTables
from towers.strategies.parameter_server.transport import Link
from towers.strategies.parameter_server.worker import BoundModel

__all__ = ["wire_stats"]


def wire_stats(links: Sequence[Link], sparse: SparseTables | None, bound: BoundModel | None,
               diloco: DiLoCo | None) -> dict[str, float]:
    """Return a worker's traffic with the ps tasks so far (all zeros without links: a ps task).

    ``bytes_sent``/``bytes_received``: everything on its ps links, headers included;
    ``rows_pulled``/``rows_pushed``: embedding rows moved, and ``row_bytes``: their values' bytes
    (the touched-rows ideal a step cannot go below); ``shared_memory_bytes``: dense gradients and
    parameters a ps task on this host read and wrote in place instead. Under ``mode="diloco"`` also
    ``inner_steps``, ``outer_steps``, ``examples`` (this worker's), ``outer_bytes_sent`` and ``outer_wait_s`` (its
    outer pushes' bytes, and seconds until their replies were in) and ``bytes_per_example`` (``bytes_sent`` /
    ``examples``).
    """
    sent = sum(link.bytes_sent for link in links)
    return {"bytes_sent": sent, "bytes_received": sum(link.bytes_received for link in links),
            "rows_pulled": sparse.rows_pulled if sparse else 0, "rows_pushed": sparse.rows_pushed if sparse else 0,
            "row_bytes": sparse.row_bytes if sparse else 0,
            "shared_memory_bytes": bound.shared_bytes if bound is not None else 0,
            **(diloco.stats(sent) if diloco is not None else {})}
