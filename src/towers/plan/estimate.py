"""``towers.plan.estimate_memory``: one replica's memory for a model, strategy, replica count, batch, precision and optimizer.

Parameters, gradients and optimizer state are counted exactly from the shapes and dtypes of the
model built on the meta device; activations come from one replica's step traced on fake tensors
(``trace.py``). What each strategy keeps where:

- ``mirrored`` (and one replica of any strategy): every replica holds every parameter, its
  optimizer state, and (from 2 replicas on) DDP's gradient buckets for the whole step, which are
  the gradients themselves (``gradient_as_bucket_view``). Under ``bf16``/``fp16`` the parameters
  stay float32; the forward runs under autocast.
- ``sharded`` (FSDP2): parameters, gradients and optimizer state are split over the replicas
  (dim 0 of each parameter, padded to a multiple of the replicas); during a step the root's own
  parameters stay gathered, and a unit's parameters are gathered around its forward and its
  backward, with the next unit's gathered early in backward (prefetch): two units at once, in the
  compute dtype (``bf16``/``fp16`` under mixed precision).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence, Union

import torch
from torch import nn

from towers.cluster import roles
from towers.errors import user_error
from towers.plan.trace import OPTIMIZERS, StepTrace, trace_step
from towers.strategies.precision import PRECISIONS

__all__ = ["MemoryEstimate", "estimate_memory", "estimate_memory_table", "trace_model", "STRATEGIES"]

#: Strategies the plan knows (names and aliases from the strategy table map onto these).
STRATEGIES = ("mirrored", "sharded")
_MEMORY_MODEL = {"one_device": "mirrored", "mirrored": "mirrored", "multi_worker_mirrored": "mirrored",
                 "sharded": "sharded"}
#: A model factory: a callable returning an ``nn.Module``, or its ``"module:function"`` / ``"file.py:function"`` path.
ModelFactory = Union[Callable[[], nn.Module], str]
_HALF = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MemoryEstimate:
    """One replica's memory in bytes: persistent state, what a step adds, and the peak.

    ``parameters`` includes buffers. ``gathered_parameters``: the sharded strategy's parameters
    gathered during a step (0 otherwise). ``communication``: buffers beyond the gradients (0 when
    DDP's buckets are the gradients). ``optimizer_temporaries``: what ``optimizer.step()`` adds while it runs.
    """

    strategy: str
    replicas: int
    batch_size: int
    precision: str
    optimizer: str
    num_parameters: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    gathered_parameters: int
    communication: int
    optimizer_temporaries: int
    peak: int

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-ready dict."""
        return asdict(self)


def _check(strategy: str, replicas: int, batch_size: int, precision: str, optimizer: str) -> tuple[str, str]:
    try:
        canonical = roles.canonical_strategy(strategy)
    except ValueError:
        canonical = ""
    if canonical not in _MEMORY_MODEL:
        raise user_error(f"strategy must be one of {', '.join(STRATEGIES)} (or an alias such as fsdp)",
                         repr(strategy), "Pass --strategy mirrored or --strategy sharded.")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise user_error("replicas must be an integer >= 1", repr(replicas), "Pass --replicas 1,2,4.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise user_error("batch_size (per replica) must be an integer >= 1", repr(batch_size), "Pass --batch-size 32.")
    if optimizer not in OPTIMIZERS:
        raise user_error(f"optimizer must be one of {', '.join(OPTIMIZERS)}", repr(optimizer),
                         "Pass --optimizer adam (or sgd, momentum, adamw).")
    name = next((canon for canon, spellings in PRECISIONS.items() if str(precision).lower() in spellings), None)
    if name is None:
        raise user_error("precision must be one of 32, bf16 or fp16", repr(precision), "Pass --precision bf16.")
    return _MEMORY_MODEL[canonical], name


def _shard_bytes(t: torch.Tensor, replicas: int) -> int:
    """Bytes of the largest shard of ``t`` (rank 0's): dim 0 split in ``replicas`` chunks, padded as FSDP2 pads."""
    if t.dim() == 0:
        return t.element_size()
    rows = math.ceil(t.shape[0] / replicas)
    return rows * (t.numel() // max(t.shape[0], 1)) * t.element_size()


def _state_bytes(optimizer: str, param_bytes: int, count: int) -> int:
    """Optimizer state: momentum 1x, Adam/AdamW 2x the parameters, plus Adam's float32 step count per parameter."""
    if optimizer == "momentum":
        return param_bytes
    if optimizer in ("adam", "adamw"):
        return 2 * param_bytes + 4 * count
    return 0


def _gathered_bytes(model: nn.Module, dtype: torch.dtype | None) -> int:
    """Sharded: the root's own parameters (kept gathered from forward to backward) plus the two largest units'."""
    from towers.parallel.fsdp import log as fsdp_log
    from towers.parallel.fsdp import select_units

    level = fsdp_log.level
    fsdp_log.setLevel(logging.ERROR)  # its note on the units chosen is for a real job, not for the plan
    try:
        units = select_units(model)
    finally:
        fsdp_log.setLevel(level)

    def size(params: list[nn.Parameter]) -> int:
        return sum(p.numel() * (p.element_size() if dtype is None else dtype.itemsize) for p in params)

    in_units = {id(p) for u in units for p in u.parameters()}
    root = size([p for p in model.parameters() if id(p) not in in_units])
    largest = sorted((size(list(u.parameters())) for u in units), reverse=True)[:2]
    return root + sum(largest) * (2 if len(largest) == 1 else 1)


def _build(model_factory: ModelFactory) -> nn.Module:
    if isinstance(model_factory, str):
        from towers.bench.user_model import load_factory

        model_factory = load_factory(model_factory, "model_factory")
    try:
        with torch.device("meta"):
            model = model_factory()
    except Exception as exc:
        raise user_error("The model factory failed when called with no arguments under torch.device('meta')",
                         f"{type(exc).__name__}: {exc}", "Make it build the model from its layers' sizes alone (no "
                         "weights loaded from files, no .to(device) calls), or wrap it in a function that does.") from exc
    if not isinstance(model, nn.Module):
        raise user_error("The model factory must return a torch.nn.Module", type(model).__name__,
                         "Return the model itself from the function (not a tuple or a state dict).", cls=TypeError)
    return model


def estimate_memory(model_factory: ModelFactory, *, strategy: str = "mirrored", replicas: int = 1,
                    batch_size: int, input_shape: tuple[int, ...] | None = None, seq_len: int | None = None,
                    vocab_size: int | None = None, precision: str = "32", optimizer: str = "adam",
                    loss: str = "cross_entropy", trace: StepTrace | None = None) -> MemoryEstimate:
    """Return one replica's memory for training ``model_factory()`` with ``strategy`` on ``replicas`` replicas.

    ``model_factory``: a callable returning the ``nn.Module``, or its path (``"mypkg.models:build"``,
    ``"path/to/file.py:build"``), called with no arguments under ``torch.device("meta")`` (no
    memory). Inputs are ``batch_size`` examples (per replica) of ``input_shape`` (float), or, with
    ``seq_len``, token ids below ``vocab_size`` (by default the model's first ``nn.Embedding``'s
    size); targets are class ids for ``loss="cross_entropy"`` (zeros shaped like the output for
    ``"mse"``). ``trace``: a ``StepTrace`` of the same model and batch to reuse
    (``estimate_memory_table`` traces once for several replica counts).

    Raises:
        ValueError: an unknown strategy, optimizer or precision, replicas or batch below 1, or no input shape.
        TypeError: when the factory does not return an ``nn.Module``.
    """
    kind, precision = _check(strategy, replicas, batch_size, precision, optimizer)
    model = _build(model_factory)
    if trace is None:
        trace = trace_model(model_factory, batch_size=batch_size, input_shape=input_shape, seq_len=seq_len,
                            vocab_size=vocab_size, precision=precision, optimizer=optimizer, loss=loss)
    trained = [p for p in model.parameters() if p.requires_grad]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    sharded = kind == "sharded" and replicas > 1  # one process: FullyShardedStrategy runs the plain model
    per_rank = (lambda t: _shard_bytes(t, replicas)) if sharded else (lambda t: t.numel() * t.element_size())
    params = sum(per_rank(p) for p in model.parameters()) + buffers
    grads = sum(per_rank(p) for p in trained)
    state = _state_bytes(optimizer, grads, len(trained))
    gathered = _gathered_bytes(model, _HALF[precision]) if sharded else 0
    if replicas == 1:  # no buckets: gradients are made in backward and freed by zero_grad
        peak = params + state + max(trace.with_gradients, grads + trace.optimizer_temporaries)
    elif sharded:  # full gradients exist one unit at a time; each rank keeps its shard of them
        peak = params + state + grads + max(trace.activations + gathered, trace.optimizer_temporaries)
    else:  # DDP's buckets hold the gradients for the whole step
        peak = params + state + grads + max(trace.activations, trace.optimizer_temporaries)
    return MemoryEstimate(
        strategy=kind, replicas=replicas, batch_size=batch_size, precision=precision, optimizer=optimizer,
        num_parameters=sum(p.numel() for p in model.parameters()), parameters=params, gradients=grads,
        optimizer_state=state, activations=trace.activations, gathered_parameters=gathered, communication=0,
        optimizer_temporaries=trace.optimizer_temporaries, peak=peak)


def trace_model(model_factory: ModelFactory, *, batch_size: int, input_shape: tuple[int, ...] | None,
                seq_len: int | None, vocab_size: int | None, precision: str, optimizer: str,
                loss: str) -> StepTrace:
    """Return the ``StepTrace`` of one replica's step of a fresh meta-device model on a batch of ``batch_size``.

    Raises:
        ValueError: neither ``input_shape`` nor ``seq_len``, or token inputs without a vocabulary size.
    """
    model = _build(model_factory)
    if seq_len is not None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise user_error("seq_len (--seq-len) must be a positive number of tokens per example", f"seq_len={seq_len!r}",
                             "Pass the sequence length the model trains on, e.g. --seq-len 256.")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
            raise user_error("vocab_size (--vocab-size) must be a positive number of token ids",
                             f"vocab_size={vocab_size!r}", "Pass e.g. --vocab-size 50257, or leave it out to use the "
                             "model's first nn.Embedding's size.")
        if vocab_size is None:
            vocab_size = next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if vocab_size is None:
            raise user_error("Token inputs need a vocabulary size, and the model has no nn.Embedding to take it from",
                             f"seq_len={seq_len!r}, vocab_size=None", "Pass --vocab-size.")
        shape, vocab = (batch_size, seq_len), vocab_size

        def make_batch() -> Any:
            return torch.randint(0, vocab, shape)
    elif input_shape:
        dims = (batch_size, *input_shape)

        def make_batch() -> Any:
            return torch.randn(dims)
    else:
        raise user_error("The plan needs the shape of one input", "neither input_shape nor seq_len",
                         "Pass --input-shape C,H,W for float inputs or --seq-len L for token ids.")
    try:
        return trace_step(model, make_batch, optimizer=optimizer, loss=loss, autocast_dtype=_HALF[precision])
    except Exception as exc:
        raise user_error("The model's forward and backward fail on a batch of the given shape",
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                         "Pass the shape it takes (--input-shape, or --seq-len for token models).") from exc


def estimate_memory_table(model_factory: ModelFactory, *, replicas: Sequence[int], **options: Any) -> list[MemoryEstimate]:
    """Return ``estimate_memory`` for each replica count in ``replicas``, tracing the step once.

    Raises:
        ValueError, TypeError: as ``estimate_memory``.
    """
    counts = list(replicas)
    if not counts:
        raise user_error("replicas must list at least one replica count", repr(replicas), "Pass e.g. replicas=[1, 2, 4].")
    for n in counts:
        _check(options.get("strategy", "mirrored"), n, options.get("batch_size", 1), options.get("precision", "32"),
               options.get("optimizer", "adam"))
    if "trace" not in options:
        keys = ("batch_size", "input_shape", "seq_len", "vocab_size", "precision", "optimizer", "loss")
        defaults: dict[str, Any] = {"input_shape": None, "seq_len": None, "vocab_size": None, "precision": "32",
                                    "optimizer": "adam", "loss": "cross_entropy"}
        args: dict[str, Any] = {k: options.get(k, defaults.get(k)) for k in keys}
        args["precision"] = _check("mirrored", 1, 1, args["precision"], args["optimizer"])[1]
        options = {**options, "trace": trace_model(model_factory, **args)}
    return [estimate_memory(model_factory, replicas=n, **options) for n in counts]
