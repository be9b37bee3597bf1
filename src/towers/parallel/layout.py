"""The parallel layout of a job: its degrees, validated once, and the one ``DeviceMesh`` a process builds from them.

A ``Layout`` is torch-free: the degrees ``pp`` (pipeline stages), ``dp_replicate`` and ``dp_shard``
(the data-parallel replicas: FSDP2 shards within ``dp_shard`` and replicates across ``dp_replicate``,
HSDP; DDP replicates over both), ``tp`` (tensor parallelism inside one replica), and room for ``cp``
and ``ep`` (context and expert parallelism, 1 until they are built). It comes from the ``MeshSpec``
that ``towers launch --mesh`` already checked (``Layout.from_spec``), so the launcher, ``towers plan``
and every strategy read one set of numbers.

``Layout.build`` makes the process's one ``DeviceMesh`` (the only ``init_device_mesh`` in towers),
outermost first ``(pp, dp_replicate, dp_shard, tp)``: tp last, so a replica's tp processes are
neighbours on a node (their collectives run every layer), the pipeline's sends (the lightest) may
cross nodes. Dimensions of size 1 are left out, except ``dp_shard``, which every layout has (FSDP2
and the loss need a data-parallel mesh even of one process). The named sub-meshes, one per use:

========  ===============================================================================
``fsdp``  what FSDP2 shards over: ``dp_shard``, or ``(dp_replicate, dp_shard)`` under HSDP
``dp``    every data-parallel replica, one dimension: the loss, the data loading, DDP
``tp``    the processes splitting one replica's layers (None without tp)
``pp``    the processes of one pipeline, one per stage position (None without pp)
========  ===============================================================================

A process's global rank is ``((p * dp_replicate + r) * dp_shard + s) * tp + t``; its replica index
(the batch share it trains) is ``r * dp_shard + s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from towers.cluster.mesh import MeshSpec
from towers.errors import InvalidArgumentError, user_error

__all__ = ["Layout", "LayoutMesh", "MESH_ORDER"]

#: The mesh's dimensions, outermost first (``cp`` and ``ep`` join here when they are built).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Layout:
    """The degrees of parallelism of one job; ``pp * dp_replicate * dp_shard * tp`` processes in all.

    Attributes:
        pp: pipeline stages (outermost).
        dp_replicate: data-parallel replicas that hold whole copies (DDP, or HSDP's replicate dimension).
        dp_shard: data-parallel processes that shard the training state (FSDP2).
        tp: tensor-parallel processes that split each layer (innermost).
        cp: context parallelism: room for it, 1 until it is built.
        ep: expert parallelism: the same.

    Raises:
        ValueError: a degree that is not a positive integer, or ``cp``/``ep`` above 1.

    Example:
        ```python
        from towers.parallel import Layout

        layout = Layout(dp_shard=2, tp=2)  # 4 processes: FSDP2 over 2, each layer split over 2
        assert layout.dp_shard * layout.tp == 4
        ```
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1  # context parallelism: room for it, 1 until it is built
    ep: int = 1  # expert parallelism: the same

    def __post_init__(self) -> None:
        for name in (*MESH_ORDER, "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise user_error(f"The layout's {name} must be a positive integer", f"{name}={value!r}",
                                 f"Use e.g. {name}=2, or 1 for no {name} dimension.")
        for name in ("cp", "ep"):
            if getattr(self, name) != 1:
                raise user_error(f"{name} parallelism is not built in towers yet", f"{name}={getattr(self, name)}",
                                 f"Leave {name} at 1; use tp, pp and dp (sharded or replicated) for now.")

    @classmethod
    def from_spec(cls, spec: MeshSpec | None, world_size: int, *, shard_group_size: int | None = None) -> "Layout":
        """Return the layout of ``world_size`` processes from a ``--mesh`` (None: every process a data-parallel replica).

        ``shard_group_size`` is HSDP's sugar: ``dp_shard`` of that many replicas, ``dp_replicate`` the rest.

        Raises:
            ValueError: the mesh does not span ``world_size`` processes, or ``shard_group_size`` does not divide dp.
        """
        spec = (spec or MeshSpec(dp=world_size)).resolved(world_size)
        if spec.dp_shard is not None and shard_group_size is not None and shard_group_size != spec.dp_shard:
            raise user_error("shard_group_size and the mesh's dp_shard say two different things",
                             f"shard_group_size={shard_group_size!r}, mesh {spec.given()}",
                             "Give the HSDP groups once: dp_replicate=R,dp_shard=S in the mesh, or shard_group_size=S.")
        if spec.dp_shard is not None:
            shard_group_size = spec.dp_shard
        shard = spec.dp if shard_group_size is None else shard_group_size
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1 or spec.dp % shard:
            if spec.pp * spec.tp == 1:
                raise InvalidArgumentError(
                    f"shard_group_size must divide the number of processes ({world_size}). Received: "
                    f"{shard_group_size!r}. Use the processes per node (HSDP: shard within a node, replicate across "
                    "nodes) or None for one group.")
            raise user_error("Under a tensor-parallel mesh, shard_group_size (HSDP: shard within groups of that many "
                             "replicas, replicate across them) must divide dp", f"shard_group_size={shard_group_size!r}, "
                             f"mesh {spec.describe()}", f"Use a divisor of dp={spec.dp}, or leave it out (shard over all).")
        return cls(pp=spec.pp, dp_replicate=spec.dp // shard, dp_shard=shard, tp=spec.tp)

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the shares the global batch is split into."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        """Processes the layout spans."""
        return self.pp * self.dp * self.tp * self.cp * self.ep

    @property
    def model_parallel(self) -> bool:
        """Whether one replica spans several processes (tp or pp above 1)."""
        return self.pp * self.tp > 1

    def spec(self) -> MeshSpec:
        """The launcher's torch-free ``MeshSpec`` of this layout (``dp`` = both data-parallel degrees)."""
        return MeshSpec(pp=self.pp, dp=self.dp, tp=self.tp, dp_shard=self.dp_shard if self.dp_replicate > 1 else None)

    def describe(self) -> str:
        """``"dp_shard=4"``, ``"dp_replicate=2,dp_shard=2,tp=2"``: the dimensions of the mesh ``build`` makes."""
        return ",".join(f"{name}={size}" for name, size in self.dims())

    def dims(self) -> list[tuple[str, int]]:
        """The mesh's ``(name, size)`` dimensions, outermost first: those above 1, and ``dp_shard`` always."""
        return [(name, getattr(self, name)) for name in MESH_ORDER if getattr(self, name) > 1 or name == "dp_shard"]

    def replica_of(self, rank: int) -> int:
        """The data-parallel index (the batch share) of global ``rank``."""
        return (rank // self.tp) % self.dp

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group's global ranks: one per ``(pp, tp)`` coordinate, pp-major."""
        width = self.dp * self.tp
        return [[p * width + d * self.tp + t for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def stage_ranks(self, rank: int, stage_positions: list[int]) -> list[int]:
        """The global ranks holding each stage of ``rank``'s pipeline, given each stage's pp coordinate."""
        width = self.dp * self.tp
        return [position * width + rank % width for position in stage_positions]

    def build(self, device_type: str) -> "LayoutMesh":
        """Return this process's ``LayoutMesh`` (a collective: every process of the job calls it, once)."""
        return LayoutMesh(self, device_type)


class LayoutMesh:
    """The one ``DeviceMesh`` of a process (``world``) and its named sub-meshes (see the module docstring).

    A collective to build: every process of the job builds it, once (``Layout.build``).

    Args:
        layout: the job's degrees.
        device_type: ``"cuda"`` or ``"cpu"``, as ``init_device_mesh`` takes it.
    """

    def __init__(self, layout: Layout, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        dims = layout.dims()
        self.layout = layout
        self.world: Any = init_device_mesh(device_type, tuple(size for _, size in dims),
                                           mesh_dim_names=tuple(name for name, _ in dims))
        names = [name for name, _ in dims]
        self.fsdp: Any = self._sub(("dp_replicate", "dp_shard") if layout.dp_replicate > 1 else ("dp_shard",), names)
        if layout.dp_replicate == 1:
            self.dp: Any = self.fsdp
        elif layout.dp_shard == 1:  # replicas only (DDP, HSDP of one-process shards): the dimension itself
            self.dp = self.world["dp_replicate"]
        else:  # torch's one way to get a group over two dimensions of a mesh is to flatten them
            self.dp = self.fsdp._flatten("dp")
        self.tp: Any = self._sub(("tp",), names) if layout.tp > 1 else None
        self.pp: Any = self._sub(("pp",), names) if layout.pp > 1 else None

    def _sub(self, wanted: tuple[str, ...], names: list[str]) -> Any:
        return self.world if tuple(names) == wanted else self.world[wanted if len(wanted) > 1 else wanted[0]]

    @property
    def replica_id(self) -> int:
        """This process's data-parallel index (its share of the batch)."""
        return int(self.dp.get_local_rank())

    def describe(self) -> str:
        """The mesh as ``"pp=2,dp_shard=2,tp=2"``."""
        return ",".join(f"{n}={s}" for n, s in zip(self.world.mesh_dim_names, self.world.shape))

    def __repr__(self) -> str:
        return f"LayoutMesh({self.describe()})"
