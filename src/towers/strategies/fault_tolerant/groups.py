"""Which replica group a process belongs to, and the group's links: its own process group, torchft's quorum client.

``GroupLayout`` resolves a process's group from the arguments or ``towers launch``'s
``TOWERS_FT_GROUP*``; ``intra_group`` makes the process group of a group's own processes;
``QuorumClient`` notes the members of each quorum torchft returns (for the logs); ``import_torchft``
imports the optional extra with an error that names the fix. ``note_quorum_members`` and
``quorum_started`` are the only places that read torchft's private manager state.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from towers.cluster.info import ProcessInfo
from towers.errors import user_error

__all__ = ["GroupLayout", "QuorumClient", "intra_group", "own_address", "import_torchft", "note_quorum_members",
           "quorum_started"]

_INSTALL_FIX = ("Install the optional extra: pip install 'towers[ft]' (torchft>=0.2, which needs torch>=2.7), "
                "or pick another strategy (mirrored).")


def import_torchft() -> Any:
    """Return the ``torchft`` module, or raise an ImportError that names the fix."""
    try:
        import torchft
        import torchft.checkpointing.transport  # noqa: F401 (the transport healing uses)
        import torchft.coordination  # noqa: F401
        import torchft.ddp  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"FaultTolerantStrategy runs on torchft, which could not be imported. Received: "
                          f"{type(exc).__name__}: {exc}. {_INSTALL_FIX}") from exc
    return torchft


def own_address(info: ProcessInfo) -> str:
    """The address the other groups reach this one at: the rendezvous host on one host, else the address of the
    interface that reaches the other hosts (which torchft's Gloo groups then bind too)."""
    from towers.network import use_interface

    choice = use_interface(info)  # None on one host (or when no interface is named or needed)
    return (choice.interface.address if choice is not None else None) or info.master_addr




@dataclass(frozen=True)
class GroupLayout:
    """Which replica group this process belongs to, its rank among the group's ``size`` processes, the store port."""

    group: int
    rank: int
    size: int
    port: int

    @staticmethod
    def resolve(info: ProcessInfo, group: int | None, size: int | None, rank: int | None,
                port: int | None) -> "GroupLayout":
        """The arguments, else what ``towers launch`` set (``info.replica_group``), else one process per group."""
        slot = info.replica_group or (info.rank, 0, 1, 0)

        def pick(value: int | None, name: str, default: int) -> int:
            raw: Any = value if value is not None else default
            if isinstance(raw, bool) or not isinstance(raw, int):
                raise user_error(f"{name} must be an integer", repr(raw), f"Pass e.g. {name}=0.")
            return raw

        layout = GroupLayout(group=pick(group, "replica_group_id", slot[0]), rank=pick(rank, "group_rank", slot[1]),
                             size=pick(size, "group_size", slot[2]), port=pick(port, "group_port", slot[3]))
        if layout.size < 1 or not 0 <= layout.rank < layout.size or layout.group < 0:
            raise user_error("a replica group needs size >= 1, 0 <= rank < size and a group id >= 0",
                             f"group={layout.group}, group_rank={layout.rank}, group_size={layout.size}",
                             "Number the processes of a group 0..group_size-1 (towers launch --group-size does).")
        if layout.size > 1 and not 0 < layout.port < 65536:
            raise user_error("a replica group of several processes needs the port where its process 0 serves the "
                             "group's store", f"group_port={layout.port}",
                             "Run under towers launch --strategy fault_tolerant --group-size N, or pass the same free "
                             "group_port to every process of the group.")
        return layout


def intra_group(store: Any, layout: GroupLayout, timeout: timedelta) -> Any:
    """The process group of this replica group's own processes (None for a group of one)."""
    if layout.size == 1:
        return None
    import torch.distributed as dist

    if dist.is_initialized():
        raise user_error("FaultTolerantStrategy with groups of several processes makes the group's own process group "
                         "the default one, but a default process group exists already", "torch.distributed initialized",
                         "Build the strategy before any other strategy or init_process_group in this process.",
                         cls=RuntimeError)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"towers/ft/group{layout.group}", store), rank=layout.rank,
                            world_size=layout.size, timeout=timeout)
    return dist.group.WORLD


class QuorumClient:
    """torchft's manager client, noting the replica group ids of each quorum it returns (for the logs)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.members: list[int] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        # torchft's Manager asks its client for each quorum through this private method (torchft 0.2 has no
        # public hook that sees the quorum's members), so the wrapper overrides it under the same name.
        quorum = self._client._quorum(*args, **kwargs)
        with contextlib.suppress(Exception):  # the ids are "towers_ft_<group>[:...]"; anything else is not logged
            self.members = sorted(int(str(r).split(":")[0].rsplit("_", 1)[1]) for r in quorum.replica_ids)
        return quorum


def note_quorum_members(manager: Any) -> QuorumClient:
    """Put a ``QuorumClient`` in front of torchft ``manager``'s client and return it (its ``members`` are then the
    replica group ids of each quorum the manager joins)."""
    # torchft keeps the client in a private attribute and offers no public way to see a quorum's members.
    client = QuorumClient(manager._client)
    manager._client = client
    return client


def quorum_started(manager: Any) -> bool:
    """True once torchft ``manager`` asked for a quorum (this group took part in a step), in this process."""
    # torchft's Manager says so only through its private future of the last quorum request.
    return manager._quorum_future is not None
