"""Tensor parallelism on the mesh's ``tp`` dimension: which layers split, checked against the model, applied once.

A plan maps module names (``*`` matches one level, as in ``blocks.*.attn.qkv``) to
``torch.distributed.tensor.parallel`` styles: ``ColwiseParallel`` splits a linear layer's outputs
(each process computes some heads, or some of the MLP's hidden units), ``RowwiseParallel`` its
inputs, summing the partial outputs in one all-reduce, so each block costs two all-reduces of its
activations in forward and two in backward. Everything else (embeddings, norms) is replicated: each
process of a replica computes it whole on the same batch.

Plans come first from the model itself: one that defines ``towers_tp_plan(tp) -> dict`` (towers' GPT,
``towers.models_gpt``, declares its own there). Built in beside them: every Hugging Face model whose config
carries ``base_model_tp_plan`` (Llama, Mistral, Qwen2, ...; the head too, where the vocabulary
divides by tp), Hugging Face's GPT-2 (its ``Conv1D`` layers, ``towers.parallel.conv1d_parallel``),
models laid out as torchtitan's Llama 3 (``layers.N.attention.wq`` ...), and the MLPs of an
``nn.Sequential`` (two linear layers with only activations between them: the first colwise, the
second rowwise, as the seed CNN's classifier). Any other model: pass ``tp_plan=`` a dict of name ->
style (the strings ``"colwise"`` / ``"rowwise"``, or style objects), or a callable
``plan(model, tp_size) -> dict``. ``sequence_parallel=True`` turns a plan into its sequence-parallel
variant (``towers.parallel.sequence_parallel``).
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Mapping, Union

import torch
from torch import nn

from towers._logging import get_logger
from towers.errors import user_error

__all__ = ["tp_option", "TPPlan", "tp_plan_for", "check_divisible", "apply_tensor_parallel", "stage_plan", "matched_modules"]

log = get_logger(__name__)

#: What ``tp_plan`` accepts: ``"auto"``, a mapping of module names to styles, or a callable returning one.
TPPlan = Union[str, Mapping[str, Any], Callable[[nn.Module, int], Mapping[str, Any]]]


def _style(value: Any, name: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    if isinstance(value, ParallelStyle):
        return value
    from torch.distributed.tensor import Shard

    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_loss_parallel": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    from towers.parallel.conv1d_parallel import CONV1D_STYLES
    from towers.parallel.sequence_parallel import SEQUENCE_STYLES

    styles.update(SEQUENCE_STYLES)
    styles.update(CONV1D_STYLES)
    if value not in styles:
        raise user_error(f"Tensor-parallel plan entry {name!r} names a style towers does not know", repr(value),
                         f"Use one of {sorted(styles)}, or a torch.distributed.tensor.parallel style object.")
    return styles[value]()


def _hf_plan(model: nn.Module) -> dict[str, Any] | None:
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None)
    if not base_plan:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    plan = {(f"{prefix}.{k}" if base is not None and base is not model else k): v for k, v in base_plan.items()}
    head_plan = getattr(type(model), "_tp_plan", None) or {}
    for name, style in head_plan.items():  # transformers names a gathered colwise head either way
        if style in ("colwise_rep", "colwise_gather_output"):
            plan[name] = "colwise_rep"
    return plan


def _hf_gpt2_plan(model: nn.Module) -> dict[str, Any] | None:
    """The plan for a Hugging Face GPT-2 (its ``Conv1D`` layers, the fused q/k/v split head by head), else None."""
    if getattr(getattr(model, "config", None), "model_type", None) != "gpt2":
        return None
    found = [name for name, m in model.named_modules() if name.endswith("attn.c_attn") and type(m).__name__ == "Conv1D"]
    if not found:
        return None
    prefix = found[0][:-len("attn.c_attn")].rstrip(".").rsplit(".", 1)[0]  # "transformer.h" or "h"
    return {f"{prefix}.*.attn.c_attn": "conv1d_colwise_qkv", f"{prefix}.*.attn.c_proj": "conv1d_rowwise",
            f"{prefix}.*.mlp.c_fc": "conv1d_colwise", f"{prefix}.*.mlp.c_proj": "conv1d_rowwise"}


#: torchtitan's Llama 3 (``torchtitan.models.llama3``): its module names, and the plan torchtitan itself applies.
_TORCHTITAN_LLAMA = {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
                     "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
                     "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
                     "layers.*.feed_forward.w2": "rowwise"}


def _torchtitan_plan(model: nn.Module) -> dict[str, Any] | None:
    """The plan for a model laid out as torchtitan's Llama 3 (``layers.N.attention.wq`` ...), else None."""
    if not all(matched_modules(model, pattern) for pattern in _TORCHTITAN_LLAMA):
        return None
    plan = dict(_TORCHTITAN_LLAMA)
    if isinstance(getattr(model, "output", None), nn.Linear):
        plan["output"] = "colwise_rep"
    return plan


#: Modules without parameters that act on each feature alone: a colwise layer's slice of features passes through them.
_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Identity)


def _sequential_mlp_plan(model: nn.Module, tp: int) -> dict[str, Any] | None:
    """The plan for the MLPs in ``model``'s ``nn.Sequential`` containers, else None: each ``Linear``, activations,
    ``Linear`` run whose hidden width divides by ``tp`` becomes colwise then rowwise (one all-reduce per MLP)."""
    plan: dict[str, Any] = {}
    for prefix, container in model.named_modules():
        if not isinstance(container, nn.Sequential):
            continue
        entries = [(f"{prefix}.{name}" if prefix else name, child) for name, child in container.named_children()]
        for i, (name, first) in enumerate(entries):
            if not isinstance(first, nn.Linear) or first.out_features % tp or name in plan:
                continue
            j = i + 1
            while j < len(entries) and isinstance(entries[j][1], _ELEMENTWISE):
                j += 1
            if j < len(entries) and isinstance(entries[j][1], nn.Linear) and entries[j][1].in_features == first.out_features:
                plan[name], plan[entries[j][0]] = "colwise", "rowwise"
    return plan or None


def tp_option(name: str, asked: bool, spec: Any) -> bool:
    """Whether option ``name`` (``sequence_parallel``, ``loss_parallel``) applies on the mesh ``spec`` (a ``MeshSpec`` or
    None); asked for without a tp above 1, it has nothing to split: a warning, and False."""
    if asked and (spec is None or spec.tp == 1):
        log.warning("%s=True is ignored: it splits over the mesh's tp processes, and this job has %s. Add a tp "
                    "dimension (--mesh dp=D,tp=T) to use it.", name, "no mesh" if spec is None else f"mesh {spec.describe()}")
    return bool(asked) and spec is not None and spec.tp > 1


def tp_plan_for(model: nn.Module, tp: int, plan: TPPlan = "auto", *, sequence_parallel: bool = False) -> dict[str, Any]:
    """Return the plan (module name pattern -> style) for ``model`` on ``tp`` processes.

    With ``sequence_parallel``, its sequence-parallel variant (``sequence_parallel_plan``; a plan that
    names sequence styles itself is kept as written).

    Raises:
        ValueError: ``"auto"`` for a model towers has no plan for; a plan of the wrong type; a plan
            towers cannot derive the sequence-parallel variant of.
    """
    found = _tp_plan(model, tp, plan)
    if not sequence_parallel:
        return found
    from towers.parallel.sequence_parallel import sequence_parallel_plan

    return sequence_parallel_plan(model, found)


def _tp_plan(model: nn.Module, tp: int, plan: TPPlan) -> dict[str, Any]:
    if callable(plan) and not isinstance(plan, str):
        plan = plan(model, tp)
    if isinstance(plan, Mapping):
        return dict(plan)
    if plan != "auto":
        raise user_error("tp_plan must be 'auto', a dict of module name -> style, or a callable", repr(plan),
                         "Use e.g. tp_plan={'layers.*.fc1': 'colwise', 'layers.*.fc2': 'rowwise'}.")
    own = getattr(model, "towers_tp_plan", None)  # a model that declares its plan (towers' GPT)
    if callable(own):
        return dict(own(tp))
    found = _hf_plan(model) or _hf_gpt2_plan(model) or _torchtitan_plan(model) or _sequential_mlp_plan(model, tp)
    if found is not None:
        return {k: v for k, v in found.items() if not _head_too_narrow(model, k, v, tp)}
    raise user_error(f"towers has no tensor-parallel plan for {type(model).__name__}", "tp_plan='auto'",
                     "Pass tp_plan= a dict naming which linear layers split their outputs ('colwise') and which "
                     "their inputs ('rowwise'), e.g. {'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise'} "
                     "(docs/model_parallel.md).")


def _head_too_narrow(model: nn.Module, pattern: str, style: Any, tp: int) -> bool:
    """True for a gathered colwise head whose vocabulary does not divide by ``tp``: it stays whole (as towers' GPT's)."""
    if style != "colwise_rep":
        return False
    heads = [m for _, m in matched_modules(model, pattern) if isinstance(m, nn.Linear)]
    if heads and all(h.out_features % tp == 0 for h in heads):
        return False
    log.info("tensor parallel: %s stays whole (its outputs do not divide by tp=%d)", pattern, tp)
    return True


def matched_modules(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs of ``model`` that a plan's ``pattern`` names (``*``: one level of names)."""
    depth = pattern.count(".")
    return [(name, m) for name, m in model.named_modules()
            if name and name.count(".") == depth and fnmatch.fnmatchcase(name, pattern)]


def check_divisible(model: nn.Module, plan: Mapping[str, Any], tp: int) -> None:
    """Refuse, before anything is split, a plan whose layers or attention heads do not divide by ``tp``.

    Raises:
        ValueError: naming the layer (or the head count), its size and ``tp``.
    """
    config = getattr(model, "config", None) or getattr(model, "model_args", None)  # towers/HF, or torchtitan
    for attr in ("n_head", "num_attention_heads", "num_key_value_heads", "n_heads", "n_kv_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise user_error(f"The model's {attr} must divide by tp (each process computes whole heads)",
                             f"{attr}={heads}, tp={tp}", f"Use a tp that divides {heads}, e.g. tp=1 or a divisor.")
    for pattern in plan:
        found = matched_modules(model, pattern)
        if not found:
            raise user_error("A tensor-parallel plan entry matches no module of the model", repr(pattern),
                             "Name modules as model.named_modules() does, with * for one level (e.g. 'blocks.*.fc1').")
        style = plan[pattern]
        kind = (style if isinstance(style, str) else type(style).__name__.lower()).removeprefix("conv1d_")
        if not kind.startswith(("colwise", "rowwise")):
            continue  # replicated parameters (norms) or a change of layout only: nothing to divide
        for name, module in found:
            if isinstance(module, nn.Linear):
                split = module.out_features if kind.startswith("colwise") else module.in_features
            elif type(module).__name__ == "Conv1D":  # Hugging Face's: weight (in, out)
                weight: Any = module.weight
                split = int(weight.shape[1] if kind.startswith("colwise") else weight.shape[0])
            else:
                continue
            if split % tp:
                raise user_error(f"Layer {name} cannot be split over tp={tp}", f"{split} features",
                                 f"Use a tp that divides {split}, or leave {name} out of the plan.")


def _replicate_rest(model: nn.Module, tp_mesh: Any) -> None:
    """Make every parameter the plan did not split a replicated DTensor on ``tp_mesh`` (its module computes on local
    tensors as before): then all parameters live on one mesh, and norms over them (torch's ``clip_grad_norm_``) work."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_replicated(_module: nn.Module, inputs: Any, mesh: Any) -> Any:
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) if isinstance(x, torch.Tensor)
                     and not isinstance(x, DTensor) else x for x in inputs)

    def to_local(_module: nn.Module, output: Any, _mesh: Any) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output

    for module in model.modules():
        own = [p for p in module.parameters(recurse=False)]
        if own and not any(isinstance(p, DTensor) for p in own):
            distribute_module(module, tp_mesh, input_fn=to_replicated, output_fn=to_local)


def _tied(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that several modules share (a head tied to the embedding), in groups."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _tie_again(model: nn.Module, ties: list[list[str]]) -> None:
    """Share each tied group's first (now distributed) parameter again: distributing gives each module its own copy.

    Raises:
        ValueError: the plan split the tied modules differently (one tensor cannot be both).
    """
    for first, *others in ties:
        param = model.get_parameter(first)
        for name in others:
            mine = model.get_parameter(name)
            if getattr(mine, "placements", None) != getattr(param, "placements", None):
                raise user_error("Tied parameters must be split alike by the tensor-parallel plan (they are one tensor)",
                                 f"{first} as {getattr(param, 'placements', None)}, {name} as "
                                 f"{getattr(mine, 'placements', None)}",
                                 "Leave both modules out of tp_plan, or give both the same style; or untie them.")
            module_name, _, attr = name.rpartition(".")
            model.get_submodule(module_name).register_parameter(attr, param)


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, plan: TPPlan = "auto", *,
                          sequence_parallel: bool = False) -> dict[str, Any]:
    """Split ``model``'s layers over ``tp_mesh`` by its plan (in place); return the plan applied.

    Raises:
        ValueError: as ``tp_plan_for`` and ``check_divisible``.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    resolved = tp_plan_for(model, tp, plan, sequence_parallel=sequence_parallel)
    check_divisible(model, resolved, tp)
    ties = _tied(model)
    parallelize_module(model, tp_mesh, {k: _style(v, k) for k, v in resolved.items()})
    for pattern in (p for p, style in resolved.items() if style == "conv1d_colwise_qkv"):
        for name, _ in matched_modules(model, pattern):  # GPT-2's attention splits q, k and v by this width: its slice
            attention = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            attention.split_size = attention.split_size // tp
    _replicate_rest(model, tp_mesh)
    _tie_again(model, ties)
    log.info("tensor parallel over %d processes: %s", tp, ", ".join(f"{k}={v}" for k, v in resolved.items()))
    return resolved


def stage_plan(model: nn.Module, stage: nn.Module, tp: int, plan: TPPlan = "auto", *,
               sequence_parallel: bool = False) -> dict[str, Any]:
    """The plan for one pipeline ``stage`` of ``model``: resolved and checked on the whole model (its config names
    the heads), then the entries naming modules this stage holds (under their original names).

    Raises:
        ValueError: as ``tp_plan_for`` and ``check_divisible``.
    """
    resolved = tp_plan_for(model, tp, plan, sequence_parallel=sequence_parallel)
    check_divisible(model, resolved, tp)
    return {pattern: style for pattern, style in resolved.items() if matched_modules(stage, pattern)}
