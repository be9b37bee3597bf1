"""Where a ``DistributedStream``'s epoch stands (``Position``: batches, examples and per-shard cursors), and the
position a saved ``state_dict`` restores, checked against this stream's settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from towers.errors import user_error

__all__ = ["Position", "position_from_state"]


@dataclass
class Position:
    """Where an epoch stands: global batches and examples consumed, and records consumed per virtual shard.

    ``files``: the portable fingerprints (``[[path, size, edges], ...]`` per shard) of the files the
    cursors count records of; None for a stream without files, or before an iteration opened them.
    """

    batch: int
    examples: int
    cursors: list[int]
    files: list[Any] | None = None

    @classmethod
    def start(cls, num_shards: int) -> Position:
        return cls(0, 0, [0] * num_shards)

    def copy(self) -> Position:
        return Position(self.batch, self.examples, list(self.cursors), self.files)  # files: never changed in place

    def consume(self, shard: int) -> None:
        self.cursors[shard] += 1
        self.examples += 1


def position_from_state(state: Mapping[str, Any], mine: Mapping[str, Any], description: str) -> tuple[int, Position]:
    """Return the epoch and position ``state`` (a stream's ``state_dict()``) restores, for a stream whose own state is
    ``mine`` (``description`` names it).

    Raises:
        ValueError: when the state was saved for another input, seed, V or shuffling, or is inconsistent.
    """
    num_shards = int(mine["num_virtual_shards"])
    for key, what in (("fingerprint", "input"), ("seed", "seed"), ("num_virtual_shards", "number of virtual "
                      "shards"), ("shuffle", "shuffle setting"), ("shuffle_block", "shuffle_block")):
        if key in state and state[key] != mine[key]:
            raise user_error(f"This checkpoint's stream position was saved for another {what} ({key}="
                             f"{state[key]!r}); this stream ({description}) has {key}={mine[key]!r}",
                             {k: state.get(k) for k in ("epoch", "examples", key)},
                             "Resume with the same input, seed, num_virtual_shards and shuffle settings, or call "
                             "set_epoch(epoch) instead of load_state_dict to start that epoch over.")
    cursors = [int(c) for c in state.get("cursors", [0] * num_shards)]
    examples = int(state.get("examples", 0))
    if len(cursors) != num_shards or sum(cursors) != examples or min(cursors, default=0) < 0:
        raise user_error("A stream position needs one cursor per virtual shard, summing to the examples consumed",
                         {"examples": examples, "cursors": cursors[:8]},
                         "Pass the dict state_dict() returned, unchanged.")
    files = state.get("files")
    if files is not None and (not isinstance(files, (list, tuple)) or len(files) != num_shards):
        raise user_error("A stream position's files need one entry per shard", type(files).__name__,
                         "Pass the dict state_dict() returned, unchanged.")
    return int(state.get("epoch", 0)), Position(int(state.get("batch", 0)), examples, cursors,
                                                None if files is None else list(files))

