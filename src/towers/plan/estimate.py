"""``towers.plan``: each rank's memory for a model, strategy, parallel layout, batch, precision and optimizer.

Parameters, gradients and optimizer state are counted exactly from the shapes and dtypes of the
model built on the meta device; activations come from one rank's step traced on fake tensors
(``trace.py``). What each strategy keeps where (the strategies and their aliases are those of
``towers.cluster.roles``, whose ``plan_memory`` column says which of these two counts applies):

- ``mirrored`` (and one replica of any strategy): every replica holds every parameter, its
  optimizer state, and (from 2 replicas on) DDP's gradient buckets for the whole step, which are
  the gradients themselves (``gradient_as_bucket_view``). Under ``bf16``/``fp16`` the parameters
  stay float32; the forward runs under autocast.
- ``sharded`` (FSDP2): parameters, gradients and optimizer state are split over the replicas
  (dim 0 of each parameter, padded to a multiple of the replicas); during a step the root's own
  parameters stay gathered, and a unit's parameters are gathered around its forward and its
  backward, with the next unit's gathered early in backward (prefetch): two units at once, in the
  compute dtype (``bf16``/``fp16`` under mixed precision).

A parallel layout (``estimate_layout``, ``towers plan --mesh``: a ``towers.parallel.layout.Layout``)
divides them further, rank by rank: ``tp`` splits the layers the model's tensor-parallel plan names
(``tp_plan_for``: a colwise linear's rows and bias, a rowwise linear's columns; the rest is
replicated), and the rank's step is traced on those split layers, so their activations are split
too (a gathered colwise head, ``colwise_rep``, also holds its whole output); ``pp`` gives each rank
its pipeline stage's modules (``split_model``) and, under 1F1B, the activations of the micro-batches
in flight on that stage (``min(micro-batches, pp - stage)``: the first stage holds the most);
``dp_shard`` divides the sharded strategy's state (FSDP2), and the mirrored strategy's not at all (DDP:
whole per replica); ``dp`` splits the global batch (``batch_size`` is per replica).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence, Union, cast

import torch
from torch import nn

from towers.cluster import roles
from towers.cluster.mesh import MeshSpec, parse_mesh
from towers.errors import user_error
from towers.parallel.layout import Layout
from towers.plan.rank_model import split_for_tp, stage_modules
from towers.plan.trace import OPTIMIZERS, StepTrace, input_maker, trace_step
from towers.strategies.precision import PRECISIONS

__all__ = ["MemoryEstimate", "LayoutEstimate", "estimate_memory", "estimate_memory_table", "estimate_layout",
           "trace_model", "STRATEGIES", "MESH_STRATEGIES"]

#: Strategies the plan estimates: the rows of ``towers.cluster.roles.STRATEGIES`` with a ``plan_memory`` count.
STRATEGIES = tuple(entry.name for entry in roles.STRATEGIES if entry.plan_memory is not None)
#: Those that also take a parallel layout (``--mesh``).
MESH_STRATEGIES = tuple(entry.name for entry in roles.STRATEGIES if entry.plan_memory is not None and entry.takes_mesh)
#: A model factory: a callable returning an ``nn.Module``, or its ``"module:function"`` / ``"file.py:function"`` path.
ModelFactory = Union[Callable[[], nn.Module], str]
_HALF = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The pipeline schedule the plan counts in-flight micro-batches for (the strategy's default).
_SCHEDULE = "1f1b"


@dataclass(frozen=True)
class MemoryEstimate:
    """One replica's memory in bytes: persistent state, what a step adds, and the peak.

    Attributes:
        strategy: the strategy estimated (``"mirrored"``, ``"sharded"``, ...).
        replicas: the replica count.
        batch_size: the examples per replica.
        precision: ``"32"``, ``"bf16"`` or ``"fp16"``.
        optimizer: the optimizer's name (``"adam"``, ``"sgd"``, ...).
        num_parameters: the model's parameter count (whole, not this replica's share).
        parameters: the bytes of this replica's parameters, buffers included.
        gradients: the bytes of its gradients.
        optimizer_state: the bytes of its optimizer state.
        activations: the bytes the step's forward keeps for backward.
        gathered_parameters: the sharded strategy's parameters gathered during a step (0 otherwise).
        communication: buffers beyond the gradients (0 when DDP's buckets are the gradients).
        optimizer_temporaries: what ``optimizer.step()`` adds while it runs.
        peak: the most bytes held at once during a step.
        mesh: under a parallel layout, its mesh (``"dp_shard=2,tp=2"``); empty otherwise.
        ranks: the global ranks this estimate is for (one pipeline stage position: every rank of it holds as
            much).
        stage: that pipeline stage.
        microbatches_in_flight: the stage's micro-batches whose activations are held at once.
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
    #: Under a parallel layout: its mesh (``"dp_shard=2,tp=2"``), the global ranks this estimate is for (one
    #: pipeline stage position: every rank of it holds as much), that stage, and its micro-batches in flight.
    mesh: str = ""
    ranks: tuple[int, ...] = ()
    stage: int = 0
    microbatches_in_flight: int = 1

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class LayoutEstimate:
    """Each rank's memory under a parallel layout: one ``MemoryEstimate`` per pipeline stage position (its ``ranks``).

    Attributes:
        strategy: the strategy estimated.
        layout: the job's degrees of parallelism.
        stages: one estimate per pipeline stage position, in stage order.
    """

    strategy: str
    layout: Layout
    stages: tuple[MemoryEstimate, ...] = field(default_factory=tuple)

    @property
    def peak(self) -> int:
        """The largest rank's peak: what the job needs of each device."""
        return max(e.peak for e in self.stages)

    def per_rank(self) -> list[MemoryEstimate]:
        """One estimate per global rank, in rank order."""
        by_rank = {rank: e for e in self.stages for rank in e.ranks}
        return [by_rank[rank] for rank in range(self.layout.world_size)]

    def to_dict(self) -> dict[str, Any]:
        """Return the layout and the per-stage estimates as a JSON-ready dict."""
        return {"strategy": self.strategy, "mesh": self.layout.describe(), "world_size": self.layout.world_size,
                "peak": self.peak, "stages": [e.to_dict() for e in self.stages]}


def _strategy(strategy: str, *, mesh: bool = False) -> tuple[str, str]:
    """Return ``(canonical name, memory count)`` of ``strategy`` from the strategy table (``towers.cluster.roles``).

    Raises:
        ValueError: a name the table does not know or the plan does not model (ps, hybrid, ...), or a mesh on a
            strategy that takes none.
    """
    try:
        entry: roles.StrategyEntry | None = roles.strategy_entry(strategy)
    except ValueError:
        entry = None
    if entry is None or entry.plan_memory is None:
        others = [e.name for e in roles.STRATEGIES if e.plan_memory is None]
        raise user_error(f"strategy must be one of {', '.join(STRATEGIES)} (or an alias such as fsdp; the plan does "
                         f"not model {', '.join(others)})", repr(strategy),
                         "Pass --strategy mirrored or --strategy sharded.")
    if mesh and not entry.takes_mesh:
        raise user_error(f"A parallel layout (--mesh) applies to the strategies {', '.join(MESH_STRATEGIES)}",
                         f"--strategy {strategy} with a mesh", "Pass --strategy sharded (or mirrored) with --mesh, or "
                         "leave --mesh out for one replica per process.")
    return entry.name, entry.plan_memory


def _check(strategy: str, replicas: int, batch_size: int, precision: str, optimizer: str,
           *, mesh: bool = False) -> tuple[str, str]:
    kind = _strategy(strategy, mesh=mesh)[1]
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
    return kind, name


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

    Args:
        model_factory: a callable returning the ``nn.Module``, or its path (``"mypkg.models:build"``,
            ``"path/to/file.py:build"``), called with no arguments under ``torch.device("meta")`` (no memory).
        strategy: the strategy (``"one_device"``, ``"mirrored"``, ``"sharded"``, ...).
        replicas: the replica count: the layout of ``replicas`` processes, one replica each
            (``estimate_layout`` with ``mesh="dp=N"``).
        batch_size: the examples per replica.
        input_shape: the shape of one example (float inputs).
        seq_len: instead of ``input_shape``: token ids of this length.
        vocab_size: the token ids' bound. Default: the model's first ``nn.Embedding``'s size.
        precision: ``"32"``, ``"bf16"`` or ``"fp16"``.
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"``, ...
        loss: ``"cross_entropy"`` (targets are class ids) or ``"mse"`` (zeros shaped like the output).
        trace: a ``StepTrace`` of the same model and batch to reuse (``estimate_memory_table`` traces once for
            several replica counts).

    Returns:
        One replica's bytes by kind and its peak.

    Example:
        ```python
        import torch
        from towers.plan import estimate_memory, format_bytes

        build = lambda: torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
        estimate = estimate_memory(build, strategy="sharded", replicas=4, batch_size=32, input_shape=(512,))
        print(format_bytes(estimate.peak), format_bytes(estimate.optimizer_state))
        ```

    Raises:
        ValueError: an unknown strategy, optimizer or precision, replicas or batch below 1, or no input shape.
        TypeError: when the factory does not return an ``nn.Module``.
    """
    kind, precision = _check(strategy, replicas, batch_size, precision, optimizer)
    options = _Options(kind=kind, batch_size=batch_size, input_shape=input_shape, seq_len=seq_len,
                       vocab_size=vocab_size, precision=precision, optimizer=optimizer, loss=loss)
    (estimate,) = _estimate(model_factory, Layout(dp_shard=replicas), options, trace=trace)
    return estimate


def estimate_layout(model_factory: ModelFactory, *, mesh: "str | Mapping[str, Any] | MeshSpec | None",
                    world_size: int | None = None, strategy: str = "sharded", batch_size: int,
                    input_shape: tuple[int, ...] | None = None, seq_len: int | None = None,
                    vocab_size: int | None = None, precision: str = "32", optimizer: str = "adam",
                    loss: str = "cross_entropy", shard_group_size: int | None = None, tp_plan: Any = "auto",
                    pp_microbatches: int | None = None) -> LayoutEstimate:
    """Return each rank's memory for training ``model_factory()`` with ``strategy`` on the parallel layout ``mesh``.

    Args:
        model_factory: as ``estimate_memory`` takes it.
        mesh: ``"dp=2,tp=2"``, ``"pp=2,dp=2"``, ... (``towers launch --mesh``), parsed and checked against
            ``world_size`` processes, as the launcher checks it.
        world_size: the job's processes. Default: the mesh's own size.
        strategy: the strategy (one that takes a mesh).
        batch_size: the examples per replica (per ``dp`` coordinate); under ``pp`` a step runs
            ``pp_microbatches`` micro-batches of it.
        input_shape: as ``estimate_memory`` takes it.
        seq_len: as ``estimate_memory`` takes it.
        vocab_size: as ``estimate_memory`` takes it.
        precision: as ``estimate_memory`` takes it.
        optimizer: as ``estimate_memory`` takes it.
        loss: as ``estimate_memory`` takes it.
        shard_group_size: HSDP's shard groups.
        tp_plan: as the strategy's (``"auto"``: the model's own ``towers_tp_plan`` or a plan towers knows).
        pp_microbatches: the micro-batches of a pipelined step. Default: one per stage, as the sharded
            strategy does.

    Returns:
        One estimate per pipeline stage position; ``format_layout_table`` prints it.

    Raises:
        ValueError: a strategy the plan does not model or that takes no mesh, a bad mesh (``MeshSpec``'s errors),
            a model tp or pp cannot split, or ``estimate_memory``'s errors.
    """
    kind, precision = _check(strategy, 1, batch_size, precision, optimizer, mesh=True)
    spec = parse_mesh(mesh) or MeshSpec(dp=world_size or 1)
    layout = Layout.from_spec(spec, spec.size if world_size is None else world_size, shard_group_size=shard_group_size)
    if pp_microbatches is not None:
        from towers.parallel.pipeline import check_microbatches

        pp_microbatches = check_microbatches(pp_microbatches, layout.pp)
    options = _Options(kind=kind, batch_size=batch_size, input_shape=input_shape, seq_len=seq_len,
                       vocab_size=vocab_size, precision=precision, optimizer=optimizer, loss=loss, tp_plan=tp_plan,
                       microbatches=pp_microbatches or layout.pp)
    return LayoutEstimate(strategy=_strategy(strategy)[0], layout=layout,
                          stages=tuple(_estimate(model_factory, layout, options)))


@dataclass(frozen=True)
class _Options:
    kind: str
    batch_size: int
    input_shape: tuple[int, ...] | None
    seq_len: int | None
    vocab_size: int | None
    precision: str
    optimizer: str
    loss: str
    tp_plan: Any = "auto"
    microbatches: int = 1


def _trace(model: nn.Module, stages: list[nn.Module], position: int, options: _Options, batch: int) -> StepTrace:
    """The step of stage ``position`` (the whole model without pp) on a (micro-)batch of ``batch`` examples."""
    first = input_maker(model, batch, input_shape=options.input_shape, seq_len=options.seq_len,
                        vocab_size=options.vocab_size)
    dtype = _HALF[options.precision]
    try:
        if len(stages) == 1:
            return trace_step(model, first, optimizer=options.optimizer, loss=options.loss, autocast_dtype=dtype)
        runs: list[Callable[[Any], Any]] = [cast(Any, stage).run_stage for stage in stages]

        def make_input() -> Any:  # what the earlier stages send this one
            x = first()
            with torch.no_grad():
                for run in runs[:position]:
                    x = run(x)
            return x
        return trace_step(stages[position], make_input, optimizer=options.optimizer, loss=options.loss,
                          autocast_dtype=dtype, forward=runs[position], last=position == len(stages) - 1,
                          materialize=model)
    except Exception as exc:
        raise user_error("The model's forward and backward fail on a batch of the given shape",
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                         "Pass the shape it takes (--input-shape, or --seq-len for token models).") from exc


def _estimate(model_factory: ModelFactory, layout: Layout, options: _Options,
              trace: StepTrace | None = None) -> list[MemoryEstimate]:
    """One ``MemoryEstimate`` per pipeline stage position of ``layout``."""
    def rank_model() -> tuple[nn.Module, list[nn.Module]]:  # a fresh one per trace (a trace moves it to fake tensors)
        model = _build(model_factory)
        if layout.tp > 1:
            split_for_tp(model, layout.tp, options.tp_plan)
        return model, stage_modules(model, layout.pp, _SCHEDULE)

    num_parameters = sum(p.numel() for p in _build(model_factory).parameters())
    _, stages = rank_model()
    world = layout.world_size
    sharded = options.kind == "sharded" and world > 1  # one process: FullyShardedStrategy runs the plain model
    shards = layout.dp_shard if sharded else 1
    microbatches = options.microbatches if layout.pp > 1 else 1
    micro = math.ceil(options.batch_size / microbatches)
    width = layout.dp * layout.tp
    estimates = []
    for position, stage in enumerate(stages):
        step = trace if trace is not None and len(stages) == 1 else _trace(*rank_model(), position, options, micro)
        trained = [p for p in stage.parameters() if p.requires_grad]
        buffers = sum(b.numel() * b.element_size() for b in stage.buffers())
        params = sum(_shard_bytes(p, shards) for p in stage.parameters()) + buffers
        grads = sum(_shard_bytes(p, shards) for p in trained)
        state = _state_bytes(options.optimizer, grads, len(trained))
        gathered = _gathered_bytes(stage, _HALF[options.precision]) if sharded else 0
        # The optimizer steps this rank's shards: its temporaries shrink as they do.
        temporaries = step.optimizer_temporaries * grads // max(step.gradients, 1) if shards > 1 else (
            step.optimizer_temporaries)
        in_flight = min(microbatches, layout.pp - position) if layout.pp > 1 else 1  # 1F1B's warm-up forwards
        activations = step.activations + (in_flight - 1) * step.saved
        if world == 1 or (layout.dp == 1 and layout.pp == 1 and not sharded):  # no buckets: made in backward, freed
            peak = params + state + max(step.with_gradients, grads + temporaries)
        elif sharded:  # full gradients exist one unit at a time; each rank keeps its shard of them
            peak = params + state + grads + max(activations + gathered, temporaries)
        else:  # DDP's buckets (or the micro-batches' accumulation) hold the gradients for the whole step
            peak = params + state + grads + max(activations, temporaries)
        estimates.append(MemoryEstimate(
            strategy=options.kind, replicas=layout.dp, batch_size=options.batch_size, precision=options.precision,
            optimizer=options.optimizer, num_parameters=num_parameters, parameters=params, gradients=grads,
            optimizer_state=state, activations=activations, gathered_parameters=gathered, communication=0,
            optimizer_temporaries=temporaries, peak=peak, mesh=layout.describe() if world > 1 else "",
            ranks=tuple(range(position * width, (position + 1) * width)), stage=position,
            microbatches_in_flight=in_flight))
    return estimates


def trace_model(model_factory: ModelFactory, *, batch_size: int, input_shape: tuple[int, ...] | None,
                seq_len: int | None, vocab_size: int | None, precision: str, optimizer: str,
                loss: str) -> StepTrace:
    """Return the ``StepTrace`` of one replica's step of a fresh meta-device model on a batch of ``batch_size``.

    Raises:
        ValueError: neither ``input_shape`` nor ``seq_len``, or token inputs without a vocabulary size.
    """
    model = _build(model_factory)
    options = _Options(kind="mirrored", batch_size=batch_size, input_shape=input_shape, seq_len=seq_len,
                       vocab_size=vocab_size, precision=precision, optimizer=optimizer, loss=loss)
    return _trace(model, [model], 0, options, batch_size)


def estimate_memory_table(model_factory: ModelFactory, *, replicas: Sequence[int], **options: Any) -> list[MemoryEstimate]:
    """Return ``estimate_memory`` for each replica count in ``replicas``, tracing the step once.

    Args:
        model_factory: as ``estimate_memory`` takes it.
        replicas: the replica counts.
        **options: ``estimate_memory``'s other arguments.

    Returns:
        One estimate per replica count, in order; ``format_table`` prints them.

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
