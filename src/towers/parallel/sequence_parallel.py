"""Sequence parallelism on the ``tp`` dimension: what a block computes per token runs on 1/tp of the sequence.

Plain tensor parallelism splits the linear layers but leaves the rest of each block (norms,
residual additions, dropout) computing on the whole sequence in every tp process. Sequence
parallelism (Megatron-LM's, as torchtitan applies it to Llama) splits that rest on the sequence
dimension: the residual stream between the split layers is ``[batch, tokens / tp, width]`` on each
process, a norm computes on its slice (``SequenceParallel``), the input of attention and of the
MLP is gathered whole (``"gather_sequence"``), and the row-split layer that ends each of them
reduce-SCATTERS its partial sums onto the slices (``"rowwise_seq"``) instead of all-reducing them.
The bytes moved stay those of plain tensor parallelism (an all-reduce is a reduce-scatter plus an
all-gather); the activations of the norms and the residual stream shrink by ``tp``.

Where the sequence is split and gathered: the first block's input is cut into slices
(``"split_sequence"``: the embeddings before it compute whole, as the model's own code reads their
sequence length for positions and masks), and the final norm's output is gathered whole
(``"sequence_parallel_gather"``) for the head and for whatever the model returns.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, SequenceParallel

from towers.errors import user_error

__all__ = ["SEQUENCE_STYLES", "SplitSequence", "GatherSequence", "SequenceParallelGather", "sequence_parallel_plan",
           "is_norm"]

_SEQ = 1  # the sequence dimension of [batch, tokens, width]


def _hidden(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, Callable[[Any], tuple[tuple, dict]]]:
    """The activation a module receives (its first positional tensor, or Hugging Face's ``hidden_states=``) and a
    function that puts a replacement back."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], lambda x: ((x, *args[1:]), kwargs)
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"], lambda x: (args, {**kwargs, "hidden_states": x})
    raise user_error(f"A sequence-parallel plan entry expects {type(module).__name__}'s activations as its first "
                     "argument or as hidden_states=", f"{len(args)} positional argument(s), keywords {sorted(kwargs)}",
                     "Leave this module out of the plan, or use sequence_parallel=False.")


class SplitSequence(ParallelStyle):
    """The module's input, whole on every tp process, becomes this process's slice of the sequence (no communication
    forward; the gradient is gathered backward). Refuses a sequence whose length ``tp`` does not divide."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        tp = device_mesh.size()

        def split(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            x, put = _hidden(mod, args, kwargs)
            tokens = x.shape[_SEQ] if x.dim() > _SEQ else 0
            if not tokens or tokens % tp:
                raise user_error("Under sequence_parallel=True the sequence length must divide by tp (each process "
                                 "of a replica keeps 1/tp of the tokens)",
                                 f"{tokens} tokens per sequence (activations of shape {tuple(x.shape)}), tp={tp}",
                                 f"Pad or cut the sequences to a multiple of {tp} tokens, or use sequence_parallel=False.")
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            return put(x.redistribute(placements=[Shard(_SEQ)]).to_local())

        module.register_forward_pre_hook(split, with_kwargs=True)
        return module


class GatherSequence(ParallelStyle):
    """The module's input, this process's slice of the sequence, is gathered whole (a DTensor replicated on tp, so the
    column-split layers inside take it as it is and the gradient is reduce-scattered back onto the slices)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def gather(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            x, put = _hidden(mod, args, kwargs)
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(_SEQ)], run_check=False)
            return put(x.redistribute(placements=[Replicate()]))

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


class SequenceParallelGather(ParallelStyle):
    """``SequenceParallel`` (the module computes on this process's slice of the sequence) whose output is then gathered
    whole, as a plain tensor: the final norm, before the head and the model's outputs."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module = SequenceParallel()._apply(module, device_mesh)

        def gather(_mod: nn.Module, _inputs: Any, output: Any) -> Any:
            return output.redistribute(placements=[Replicate()]).to_local() if isinstance(output, DTensor) else output

        module.register_forward_hook(gather)  # after SequenceParallel's own output hook
        return module


#: The styles a plan may name by string for sequence parallelism.
SEQUENCE_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "sequence_parallel": SequenceParallel,
    "sequence_parallel_gather": SequenceParallelGather,
    "split_sequence": SplitSequence,
    "gather_sequence": GatherSequence,
    "rowwise_seq": lambda: RowwiseParallel(output_layouts=Shard(_SEQ)),
}


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer (``LayerNorm``, ``RMSNorm``, Hugging Face's ``LlamaRMSNorm``...)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def _refuse(model: nn.Module, why: str, received: Any) -> Exception:
    return user_error(f"towers cannot derive a sequence-parallel plan for {type(model).__name__}: {why}", received,
                      "Pass tp_plan= a dict naming the sequence styles yourself ('split_sequence', 'sequence_parallel', "
                      "'gather_sequence', 'rowwise_seq', 'sequence_parallel_gather'; docs/model_parallel.md), "
                      "or use sequence_parallel=False.")


def sequence_parallel_plan(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """Return the sequence-parallel variant of a tensor-parallel ``plan`` of ``"colwise"`` / ``"rowwise"`` layers.

    The plan's split layers must sit in modules (``blocks.*.attn``) that are children of one stack of
    blocks (``blocks.*``) whose other children with parameters are norms, and the stack must be
    followed by one final norm next to it (``ln_f``), as in towers' GPT and Hugging Face's Llama family.
    A plan that already names a sequence style is returned as it is.

    Raises:
        ValueError: when the model or the plan is not of that shape (naming what was found).
    """
    if any(isinstance(v, str) and v in SEQUENCE_STYLES for v in plan.values()):
        return dict(plan)
    unknown = {k: v for k, v in plan.items() if v not in ("colwise", "rowwise", "colwise_rep")}
    if unknown:
        raise _refuse(model, "it derives one only from 'colwise', 'rowwise' and 'colwise_rep' entries", unknown)
    split = [k for k, v in plan.items() if v in ("colwise", "rowwise")]
    parents = sorted({k.rpartition(".")[0] for k in split})
    blocks = {p.rpartition(".")[0] for p in parents}
    if not split or len(blocks) != 1 or not next(iter(blocks)).endswith(".*"):
        raise _refuse(model, "the split layers must be inside modules of one stack of blocks, like "
                      "'blocks.*.attn.qkv'", sorted(plan))
    block = next(iter(blocks))
    stack = block[:-2]
    modules = dict(model.named_modules())
    container = modules.get(stack)
    first = next(iter(container.named_children()), None) if container is not None else None
    if first is None:
        raise _refuse(model, f"no stack of blocks named {stack!r}", sorted(modules)[:20])
    norms = []
    for name, child in first[1].named_children():
        full = f"{block}.{name}"
        if is_norm(child):
            norms.append(full)
        elif full not in parents and any(True for _ in child.parameters()):
            raise _refuse(model, f"each block's modules with parameters must be norms or hold the split layers, "
                          f"and {full} ({type(child).__name__}) is neither", sorted(plan))
    top_name = stack.rpartition(".")[0]
    top = modules[top_name]
    finals = [f"{top_name}.{n}" if top_name else n for n, m in top.named_children() if is_norm(m)]
    if len(finals) != 1:
        raise _refuse(model, f"the stack {stack!r} must be followed by one final norm next to it, whose output is "
                      "gathered whole", f"norms {finals}")
    derived: dict[str, Any] = {f"{stack}.{first[0]}": "split_sequence"}
    derived.update({n: "sequence_parallel" for n in norms})
    derived.update({p: "gather_sequence" for p in parents})
    derived.update({k: "rowwise_seq" if v == "rowwise" else v for k, v in plan.items() if k in split})
    derived[finals[0]] = "sequence_parallel_gather"
    derived.update({k: v for k, v in plan.items() if k not in split})  # the head: it reads the gathered output
    return derived
