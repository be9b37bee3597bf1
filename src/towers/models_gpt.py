"""A small GPT language model (decoder-only transformer) for the sharded examples and the memory benchmark.

Written here so nothing is downloaded: token and position embeddings, ``n_layer`` pre-norm
blocks (causal self-attention through ``scaled_dot_product_attention``, a 4x MLP), a final
LayerNorm and an untied output head. The blocks live in one ``nn.ModuleList``, so the default
sharding policy makes each block one FSDP unit. Sizes, for orientation (vocabulary 8,192,
context 256): ``GPTConfig.tiny()`` ~32k parameters (tests), ``GPTConfig.small()`` ~70M
(the benchmark: 8 layers, width 768); ``GPTConfig.large()`` ~1.04B, a model that fills one GPU
(18 layers, width 2048, vocabulary 32,768, context 2048).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from towers.errors import InvalidArgumentError

__all__ = ["GPTConfig", "GPT", "Block", "random_tokens"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT: ``vocab_size`` tokens, ``block_size`` context, ``n_layer`` blocks of ``n_head`` heads over ``n_embd``."""

    vocab_size: int = 8192
    block_size: int = 256
    n_layer: int = 8
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"GPTConfig.{field} must be a positive integer. Received: {value!r}.")
        if self.n_embd % self.n_head:
            raise InvalidArgumentError(
                f"GPTConfig.n_embd must be a multiple of n_head. Received: n_embd={self.n_embd}, n_head={self.n_head}. "
                "Pick n_embd = n_head * head_size.")
        if not 0.0 <= self.dropout < 1.0:
            raise InvalidArgumentError(f"GPTConfig.dropout must be in [0, 1). Received: {self.dropout!r}.")

    @classmethod
    def tiny(cls) -> "GPTConfig":
        """A ~32k-parameter GPT for tests: 2 layers, width 32, vocabulary 97, context 16."""
        return cls(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32)

    @classmethod
    def small(cls) -> "GPTConfig":
        """The ~70M-parameter GPT of the memory benchmark: 8 layers, width 768, vocabulary 8,192, context 256."""
        return cls()

    @classmethod
    def large(cls) -> "GPTConfig":
        """A ~1.04B-parameter GPT that fills one 80 GB GPU: 18 layers, width 2048, 16 heads, vocabulary 32,768, context 2048."""
        return cls(vocab_size=32768, block_size=2048, n_layer=18, n_head=16, n_embd=2048)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which a token sees only itself and earlier tokens.

    ``qkv``'s outputs are laid out head by head (each head's query, key and value side by side), so
    any contiguous slice of whole heads is a self-contained attention: tensor parallelism gives each
    process such a slice (its ``ColwiseParallel`` split) and the forward reads the heads it holds.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(x).view(b, t, -1, 3, c // self.n_head)  # [batch, tokens, heads held here, q/k/v, head size]
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd), nn.Dropout(config.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only language model: ``GPT(config)(idx)`` maps token ids ``[B, T]`` to logits ``[B, T, vocab_size]``.

    ``model(idx, targets)`` also returns the mean token loss, as nanoGPT's does (``Trainer`` without
    ``loss=`` trains on it, ``ignore_index=-1``).

    It declares its own plans for model parallelism, as Hugging Face models carry ``base_model_tp_plan``:
    ``towers_tp_plan(tp)`` (which layers split over ``tp``) and ``towers_pipeline_units()`` with
    ``towers_stage_forward`` (how pipeline stages cut it). Any model may define the same three to be
    split by ``--mesh tp=...`` or ``pp=...`` (``towers.parallel``).
    """

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        self.config = config = config or GPTConfig()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Return the logits; given ``targets`` (nanoGPT's convention, ``-1`` ignored), ``(logits, mean token loss)``."""
        t = idx.size(1)
        if t > self.config.block_size:
            raise InvalidArgumentError(
                f"GPT input has {t} tokens per row; this model's context is block_size={self.config.block_size}. "
                "Cut the sequences or build the model with a larger block_size.")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits, loss

    def towers_tp_plan(self, tp: int) -> dict[str, str]:
        """Return the tensor-parallel plan for ``tp`` processes: attention and MLP split Megatron-style (their first
        linear by output, their second by input), the head by vocabulary where ``vocab_size`` divides by ``tp``."""
        plan = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise",
                "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
        if self.config.vocab_size % tp == 0:
            plan["head"] = "colwise_rep"  # each process computes a slice of the vocabulary; the logits are gathered
        return plan

    def towers_pipeline_units(self) -> list[tuple[str, nn.Module]]:
        """Return the ``(name, module)`` units a pipeline cuts this model into, in order; stages begin at a block."""
        return [("wte", self.wte), ("wpe", self.wpe), *((f"blocks.{i}", b) for i, b in enumerate(self.blocks)),
                ("ln_f", self.ln_f), ("head", self.head)]

    @staticmethod
    def towers_stage_forward(config: GPTConfig, modules: dict[str, nn.Module], x: torch.Tensor, *, first: bool,
                             last: bool) -> torch.Tensor:
        """``forward`` of one pipeline stage holding ``modules``: the embeddings on the first, ``ln_f`` and the head on
        the last."""
        if first:
            t = x.size(1)
            if t > config.block_size:
                raise InvalidArgumentError(
                    f"GPT input has {t} tokens per row; this model's context is block_size={config.block_size}. "
                    "Cut the sequences or build the model with a larger block_size.")
            x = modules["wte"](x) + modules["wpe"](torch.arange(t, device=x.device))
        for name, module in modules.items():
            if name.startswith("blocks."):
                x = module(x)
        if last:
            x = modules["head"](modules["ln_f"](x))
        return x

    def num_parameters(self) -> int:
        """Return the number of parameters (each tensor counted once)."""
        return sum(p.numel() for p in self.parameters())


def random_tokens(num_sequences: int, config: GPTConfig, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(inputs, targets)``: ``num_sequences`` random token rows and the same rows shifted by one.

    A map-style dataset for ``strategy.distribute_dataset`` with no download; the model learns
    the unigram statistics of the generator, which is enough to see the loss fall.
    """
    g = torch.Generator().manual_seed(seed)
    # A skewed token distribution (Zipf-like), so there is something to learn.
    weights = 1.0 / torch.arange(1, config.vocab_size + 1, dtype=torch.float64, device="cpu")  # any scope's device
    tokens = torch.multinomial(weights, num_sequences * (config.block_size + 1), replacement=True, generator=g)
    tokens = tokens.view(num_sequences, config.block_size + 1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
