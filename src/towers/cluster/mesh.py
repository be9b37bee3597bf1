"""The job's device mesh from outside the script: ``"dp=2,tp=2"`` parsed, checked against the processes, built.

``dp`` is data parallelism (each coordinate a model replica on its own share of the batch, sharded
by FSDP2 within it), ``tp`` tensor parallelism (the processes of one replica split each layer's
matrices). The mesh's last dimension is ``tp``, so a replica's processes are neighbours on a node
(their collectives run every layer; the data-parallel ones once per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from towers.errors import user_error

__all__ = ["MeshSpec", "parse_mesh", "MESH_DIMS"]

#: The mesh dimensions towers knows, outermost first.
MESH_DIMS = ("dp", "tp")


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of the mesh's dimensions; ``dp * tp`` processes in all."""

    dp: int = 1
    tp: int = 1

    @property
    def size(self) -> int:
        """Processes the mesh spans."""
        return self.dp * self.tp

    def describe(self) -> str:
        """``"dp=2,tp=2"``."""
        return f"dp={self.dp},tp={self.tp}"

    def resolved(self, world_size: int) -> "MeshSpec":
        """The spec for ``world_size`` processes: a ``dp`` left at 1 with ``tp`` given takes the rest.

        Raises:
            ValueError: when the mesh does not span exactly ``world_size`` processes.
        """
        spec = self
        if spec.dp == 1 and spec.tp > 1 and world_size % spec.tp == 0:
            spec = MeshSpec(dp=world_size // spec.tp, tp=spec.tp)
        if spec.size != world_size:
            raise user_error(f"The mesh must span the job's {world_size} process(es) (dp x tp = {world_size})",
                             f"mesh {self.describe()} ({self.size} processes)",
                             f"Use e.g. dp={max(1, world_size // max(1, self.tp))},tp={self.tp} if {self.tp} divides "
                             f"{world_size}, or launch dp x tp processes.")
        return spec


def parse_mesh(value: "str | Mapping[str, Any] | MeshSpec | None") -> MeshSpec | None:
    """Return the ``MeshSpec`` of ``"dp=2,tp=2"`` (or a mapping, or None: no mesh).

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
            hint = " (pipeline parallelism is not built yet)" if name == "pp" else ""
            raise user_error(f"Unknown mesh dimension{hint}", repr(name),
                             f"Use the dimensions {', '.join(MESH_DIMS)}, e.g. dp=2,tp=2.")
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
