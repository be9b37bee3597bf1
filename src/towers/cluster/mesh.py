"""The job's device mesh from outside the script: ``"pp=2,dp=2,tp=2"`` parsed, checked against the processes, built.

``pp`` is pipeline parallelism (each coordinate one stage of the model's blocks; activations pass
between stages once per micro-batch), ``dp`` data parallelism (each coordinate a model replica on its
own share of the batch, sharded by FSDP2 within it; or given as ``dp_replicate`` x ``dp_shard``, HSDP:
sharded within groups of ``dp_shard`` replicas, replicated across them), ``tp`` tensor parallelism (the processes of one
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
#: ``dp`` given as its two factors (HSDP), instead of ``dp``.
DP_FACTORS = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of the mesh's dimensions; ``pp * dp * tp`` processes in all."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    #: HSDP: FSDP2 shards within groups of this many replicas, replicates across them (None: over all of dp).
    dp_shard: int | None = None

    @property
    def size(self) -> int:
        """Processes the mesh spans."""
        return self.pp * self.dp * self.tp

    def describe(self) -> str:
        """``"dp=2,tp=2"`` (``"pp=2,dp=2,tp=1"`` with a pipeline; ``"dp_replicate=2,dp_shard=2,tp=2"`` under HSDP)."""
        return (f"pp={self.pp}," if self.pp > 1 else "") + f"{self._dp_text()},tp={self.tp}"

    def given(self) -> str:
        """The dimensions as a user gives them: a ``dp`` of 1 left out when another dimension is set (``"tp=3"``)."""
        parts = [(self._dp_text() if name == "dp" else f"{name}={getattr(self, name)}") for name in MESH_DIMS
                 if getattr(self, name) > 1 or (name == "dp" and self.pp * self.tp == 1)]
        return ",".join(parts)

    def _dp_text(self) -> str:
        if self.dp_shard is None:
            return f"dp={self.dp}"
        return f"dp_replicate={self.dp // max(self.dp_shard, 1)},dp_shard={self.dp_shard}"

    def _fix(self, world_size: int) -> str:
        """What to do when the mesh does not span ``world_size`` processes: meshes that do, or the processes it needs."""
        fits = [MeshSpec(dp=world_size)] if self.pp * self.tp == 1 else []
        if self.pp * self.tp > 1 and world_size % (self.pp * self.tp) == 0:  # only dp is off: the rest takes it
            fits.append(MeshSpec(pp=self.pp, dp=1, tp=self.tp))
        if world_size % self.pp == 0:  # keep pp, the tp that divides the rest nearest the one asked for
            rest = world_size // self.pp
            divisors = sorted((t for t in range(2, rest + 1) if rest % t == 0), key=lambda t: (abs(t - self.tp), t))
            fits += [MeshSpec(pp=self.pp, dp=1, tp=t) for t in divisors[:2] if t != self.tp or not fits]
        if self.tp == 1 and self.pp > 1:  # a pipeline only: the pp that divides the processes nearest the one asked
            pps = sorted((p for p in range(2, world_size + 1) if world_size % p == 0), key=lambda p: (abs(p - self.pp), p))
            fits += [MeshSpec(pp=p) for p in pps[:2]]
        shown = list(dict.fromkeys(f.given() for f in fits if f.given() != self.given()))[:2]
        need = self.pp * self.tp * (self.dp if self.dp > 1 else 1)
        launch = f"launch a multiple of {need} processes" if self.dp == 1 else f"launch {need} processes"
        if not shown:
            return f"Use a mesh whose sizes multiply to {world_size} (or no --mesh), or {launch}."
        return f"Use --mesh {' or --mesh '.join(shown)} on {world_size} processes, or {launch} for --mesh {self.given()}."

    def resolved(self, world_size: int) -> "MeshSpec":
        """The spec for ``world_size`` processes: a ``dp`` left at 1 with ``pp`` or ``tp`` given takes the rest.

        Raises:
            ValueError: when the mesh does not span exactly ``world_size`` processes.
        """
        spec, other = self, self.pp * self.tp
        if spec.dp == 1 and spec.dp_shard is None and other > 1 and world_size % other == 0:
            spec = MeshSpec(pp=self.pp, dp=world_size // other, tp=self.tp)
        if spec.size != world_size:
            dims = "pp x dp x tp" if self.pp > 1 else "dp x tp"
            raise user_error(f"The mesh must span the job's {world_size} process(es) ({dims} = {world_size})",
                             f"--mesh {self.given()}{'' if self.given() == self.describe() else f', i.e. {self.describe()}'} "
                             f"({self.size} processes)",
                             self._fix(world_size))
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
        if name not in MESH_DIMS + DP_FACTORS:
            raise user_error("Unknown mesh dimension", repr(name),
                             f"Use the dimensions {', '.join(MESH_DIMS)} (dp also as dp_replicate and dp_shard), e.g. "
                             "dp=2,tp=2 or pp=2,dp=2.")
        if name in sizes:
            raise user_error("A mesh dimension is given twice", repr(value), "Give each dimension once.")
        try:
            n = int(size)
        except (TypeError, ValueError):
            n = 0
        if n < 1 or str(size).strip() not in (str(n), f"{n}"):
            raise user_error(f"Mesh dimension {name} must be a positive integer", repr(size), f"Use e.g. {name}=2.")
        sizes[name] = n
    if any(name in sizes for name in DP_FACTORS):
        if "dp" in sizes:
            raise user_error("A mesh gives dp, or its two factors dp_replicate and dp_shard (HSDP), not both",
                             repr(value), "Drop dp, or give dp alone (shard over all of it).")
        replicate, shard = sizes.pop("dp_replicate", 1), sizes.pop("dp_shard", 1)
        return MeshSpec(dp=replicate * shard, dp_shard=shard, **sizes)
    return MeshSpec(**sizes)
