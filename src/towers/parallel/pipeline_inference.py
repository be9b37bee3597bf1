"""A pipelined model's forward without a backward (evaluation, prediction): ``model(x)`` under ``torch.no_grad()``.

Training runs a schedule over micro-batches (``strategy.forward_backward``). Evaluation needs no
schedule: each stage of a pipeline takes the whole batch in turn. Stage 0 runs its modules on the
``x`` it was given; every later stage receives the previous stage's output (a header with its
dtype and shape, then the tensor, by send/recv on the pipeline's group, or as it is where the
previous stage is on the same process: schedules with two stages per process) and runs its modules
on it; the last stage's output is broadcast back to every stage of the pipeline. A process runs its
stages in stage order, so the hand-offs meet: each waits only for an earlier stage. So
``model(x)`` returns the whole model's output on every process, which ``Trainer.evaluate``,
``predict`` and ``fit(validation_data=...)`` (and a custom evaluation loop) then use as on one
device. Every stage of a pipeline must call it with the same batch, as every stage does in training.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from towers.errors import user_error

__all__ = ["forward_through_stages"]

#: The dtypes a tensor between stages may have, by their code in the header.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8)
_MAX_DIMS = 8


def _header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
        raise user_error("A pipeline stage's output goes to the next stage as one tensor of a common dtype with at "
                         f"most {_MAX_DIMS} dimensions", f"dtype {tensor.dtype}, shape {tuple(tensor.shape)}",
                         "Make each stage return one float or integer tensor (batch first).")
    shape = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
    return torch.tensor([tensor.dim(), _DTYPES.index(tensor.dtype), *shape], dtype=torch.int64, device=tensor.device)


def _empty_from(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    dims, code, *shape = (int(v) for v in header.tolist())
    return torch.empty(shape[:dims], dtype=_DTYPES[code], device=device)


def forward_through_stages(stage: Any, x: Any, run: Callable[[torch.Tensor, int], torch.Tensor], *, group: Any,
                           stage_ranks: Sequence[int], rank: int, device: torch.device) -> torch.Tensor:
    """Return the whole model's output for ``x``: this process's stages run by ``run(inputs, stage_index)``, each between
    its neighbours.

    ``stage_ranks``: the global rank holding each stage of this pipeline (the last one's output is what
    every stage returns); ``rank``: this process's.

    Raises:
        TypeError: stage 0 given something else than one tensor.
    """
    import torch.distributed as dist

    from towers.process_group import collective

    output = torch.empty(0)
    last = len(stage_ranks) - 1
    for index in stage.stage_indices:
        if index == 0:
            if isinstance(x, tuple) and len(x) == 1:
                x = x[0]
            if not isinstance(x, torch.Tensor):
                raise user_error("Under pipeline parallelism the model's input is one tensor (batch first), which stage "
                                 "0 takes", f"an input of type {type(x).__name__}", "Call model(x) with x one tensor.",
                                 cls=TypeError)
            inputs = x.to(device)
        elif stage_ranks[index - 1] == rank:  # the previous stage is this process's own
            inputs = output
        else:
            header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
            with collective(f"pipeline evaluation: stage {index}'s input from the previous stage"):
                dist.recv(header, src=stage_ranks[index - 1], group=group)
                inputs = _empty_from(header, device)
                dist.recv(inputs, src=stage_ranks[index - 1], group=group)
        output = run(inputs, index).contiguous()
        if index < last and stage_ranks[index + 1] != rank:
            with collective(f"pipeline evaluation: stage {index}'s output to the next stage"):
                dist.send(_header(output), dst=stage_ranks[index + 1], group=group)
                dist.send(output, dst=stage_ranks[index + 1], group=group)
    holds_last = stage_ranks[last] == rank
    with collective("pipeline evaluation: the last stage's output to every stage"):
        header = _header(output) if holds_last else torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
        dist.broadcast(header, src=stage_ranks[last], group=group)
        result = output if holds_last else _empty_from(header, device)
        dist.broadcast(result, src=stage_ranks[last], group=group)
    return result
