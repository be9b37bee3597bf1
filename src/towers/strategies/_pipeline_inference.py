"""A pipelined model's forward without a backward (evaluation, prediction): ``model(x)`` under ``torch.no_grad()``.

Training runs a schedule over micro-batches (``strategy.forward_backward``). Evaluation needs no
schedule: each stage of a pipeline takes the whole batch in turn. Stage 0 runs its modules on the
``x`` it was given; every later stage receives the previous stage's output (a header with its
dtype and shape, then the tensor, by send/recv on the pipeline's group) and runs its modules on it;
the last stage's output is broadcast back to every stage of the pipeline. So ``model(x)`` returns
the whole model's output on every process, which ``Trainer.evaluate``, ``predict`` and
``fit(validation_data=...)`` (and a custom evaluation loop) then use as on one device. Every stage
of a pipeline must call it with the same batch, as every stage does in training.
"""

from __future__ import annotations

from typing import Any, Callable

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


def forward_through_stages(stage: Any, x: Any, run: Callable[[torch.Tensor], torch.Tensor], *, group: Any,
                           previous_rank: int | None, next_rank: int | None, last_rank: int,
                           device: torch.device) -> torch.Tensor:
    """Return the whole model's output for ``x``: this stage's part run by ``run``, between its neighbours'.

    ``previous_rank`` / ``next_rank``: global ranks of the stages before and after this one (None at
    the ends); ``last_rank``: this pipeline's last stage, whose output every stage returns.

    Raises:
        TypeError: stage 0 given something else than one tensor.
    """
    import torch.distributed as dist

    from towers.process_group import collective

    if previous_rank is None:
        if isinstance(x, tuple) and len(x) == 1:
            x = x[0]
        if not isinstance(x, torch.Tensor):
            raise user_error("Under pipeline parallelism the model's input is one tensor (batch first), which stage 0 "
                             "takes", f"an input of type {type(x).__name__}", "Call model(x) with x one tensor.",
                             cls=TypeError)
        inputs = x.to(device)
    else:
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
        with collective(f"pipeline evaluation: stage {stage.stage_index}'s input from the previous stage"):
            dist.recv(header, src=previous_rank, group=group)
            inputs = _empty_from(header, device)
            dist.recv(inputs, src=previous_rank, group=group)
    output = run(inputs).contiguous()
    with collective(f"pipeline evaluation: stage {stage.stage_index}'s output to the next stage"):
        if next_rank is not None:
            dist.send(_header(output), dst=next_rank, group=group)
            dist.send(output, dst=next_rank, group=group)
        header = _header(output) if next_rank is None else torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
        dist.broadcast(header, src=last_rank, group=group)
        result = output if next_rank is None else _empty_from(header, device)
        dist.broadcast(result, src=last_rank, group=group)
    return result
