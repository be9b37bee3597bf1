"""The repeated blocks of a model: what FSDP2 shards as units (``shard_units="auto"``) and activation
checkpointing recomputes (``prepare(..., activation_checkpointing=)``), found one way for both."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from torch import nn

__all__ = ["BLOCK_CONTAINERS", "repeated_blocks", "describe_blocks"]

#: The containers a model keeps its stack of blocks in (a GPT's ``nn.ModuleList``, torchtitan's ``nn.ModuleDict``).
BLOCK_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _repeated_children(container: nn.Module) -> list[nn.Module]:
    """The children of ``container`` whose class appears there at least twice (and that hold parameters).

    In an ``nn.Sequential`` only modules with submodules of their own count: a Sequential of
    ``Linear`` and ``ReLU`` layers is an MLP (or a small CNN), not a stack of blocks.
    """
    children = [c for c in container.children() if _has_parameters(c)]
    if isinstance(container, nn.Sequential):
        children = [c for c in children if any(True for _ in c.children())]
    counts = Counter(type(c) for c in children)
    return [c for c in children if counts[type(c)] >= 2]


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Return every repeated block of ``model``'s block containers, the outermost ones (a block is not searched inside).

    A block is a child of an ``nn.ModuleList``, ``nn.ModuleDict`` or ``nn.Sequential`` whose class
    appears there at least twice and that holds parameters: the transformer blocks of a GPT, Llama,
    ViT or BERT. An empty list when the model has none.
    """
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        blocks = _repeated_children(module) if isinstance(module, BLOCK_CONTAINERS) else []
        found.extend(blocks)
        for child in module.children():
            if not any(child is b for b in blocks):
                visit(child)

    visit(model)
    return found


def describe_blocks(units: Sequence[nn.Module], noun: str = "unit") -> str:
    """``"4 TransformerBlock units"``, ``"2 DenseBlock + 2 MoEBlock units"``: the modules by class, in model order."""
    counts = Counter(type(u).__name__ for u in units)
    return " + ".join(f"{n} {name}" for name, n in counts.items()) + (f" {noun}" if len(units) == 1 else f" {noun}s")
