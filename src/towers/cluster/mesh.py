"""The job's device mesh from outside the script: ``"pp=2,dp=2,tp=2"`` parsed, checked against the processes, built.

``pp`` is pipeline parallelism (each coordinate one stage of the model's blocks; activations pass
between stages once per micro-batch), ``dp`` data parallelism (each coordinate a model replica on its
own share of the batch, sharded by FSDP2 within it), ``tp`` tensor parallelism (the processes of one
replica split each layer's matrices). The order is ``(pp, dp, tp)``, tp last, so a replica's tp
processes are neighbours on a node (their collectives run every layer; the data-parallel ones once
per step; the pipeline's sends, the lightest, may cross nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from towers.errors import user_error

__all__ = ["MeshSpec", "parse_mesh", "MESH_DIMS"]

#: The mesh dimensions towers knows, outermost first.
MESH_DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of the mesh's dimensions; ``pp * dp * tp`` processes in all."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def size(self) -> int:
        """Processes the mesh spans."""
        return self.pp * self.dp * self.tp

    def describe(self) -> str:
        """``"dp=2,tp=2"`` (``"pp=2,dp=2,tp=1"`` with a pipeline)."""
        return (f"pp={self.pp}," if self.pp > 1 else "") + f"dp={self.dp},tp={self.tp}"

    def resolved(self, world_size: int) -> "MeshSpec":
        """The spec for ``world_size`` processes: a ``dp`` left at 1 with ``pp`` or ``tp`` given takes the rest.

        Raises:
            ValueError: when the mesh does not span exactly ``world_size`` processes.
        """
        spec, other = self, self.pp * self.tp
        if spec.dp == 1 and other > 1 and world_size % other == 0:
            spec = MeshSpec(pp=self.pp, dp=world_size // other, tp=self.tp)
        if spec.size != world_size:
            dims = "pp x dp x tp" if self.pp > 1 else "dp x tp"
            pp = f"pp={self.pp}," if self.pp > 1 else ""
            raise user_error(f"The mesh must span the job's {world_size} process(es) ({dims} = {world_size})",
                             f"mesh {self.describe()} ({self.size} processes)",
                             f"Use e.g. {pp}dp={max(1, world_size // max(1, other))},tp={self.tp} if {other} divides "
                             f"{world_size}, or launch {dims} processes.")
        return spec


def parse_mesh(value: "str | Mapping[str, Any] | MeshSpec | None") -> MeshSpec | None:
    """Return the ``MeshSpec`` of ``"dp=2,tp=2"`` or ``"pp=2,dp=2"`` (or a mapping, or None: no mesh).

    Raises:
        ValueError: an unknown dimension, a size that is not a positive integer, or a dimension given twice.
    """
    if value is None or isinstance(value, MeshSpec):
        return value
    if isinstance(value, str):
        pairs: list[tuple[str, Any]] = []
        for part in (p.strip() for p in value.split(",") if p.strip()):
            name, sep, size = part.partition("=")
            if not sep:
                raise user_error("A mesh is a list of NAME=SIZE", repr(value), "Use e.g. --mesh dp=2,tp=2.")
            pairs.append((name.strip(), size.strip()))
    elif isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        raise user_error("A mesh is a string like 'dp=2,tp=2' or a mapping", repr(value), "Use e.g. mesh='dp=2,tp=2'.")
    sizes: dict[str, int] = {}
    for name, size in pairs:
        if name not in MESH_DIMS:
            raise user_error("Unknown mesh dimension", repr(name),
                             f"Use the dimensions {', '.join(MESH_DIMS)}, e.g. dp=2,tp=2 or pp=2,dp=2.")
        if name in sizes:
            raise user_error("A mesh dimension is given twice", repr(value), "Give each dimension once.")
        try:
            n = int(size)
        except (TypeError, ValueError):
            n = 0
        if n < 1 or str(size).strip() not in (str(n), f"{n}"):
            raise user_error(f"Mesh dimension {name} must be a positive integer", repr(size), f"Use e.g. {name}=2.")
        sizes[name] = n
    return MeshSpec(**sizes)
