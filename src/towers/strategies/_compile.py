"""``prepare(..., compile=...)``: ``torch.compile`` applied by the strategy, after its own wrapping.

The order matters: the strategy wraps first (DDP, precision) and compiles the wrapped module, as
PyTorch recommends for DDP (TorchDynamo then splits the graph at DDP's bucket boundaries so the
all-reduce still overlaps the backward pass). Inductor, the default backend, builds C++ kernels
on the CPU: without a C++ compiler that fails deep inside the first step, so it is checked here
and the error says how to continue.
"""

from __future__ import annotations

import shutil
from typing import Any, Mapping

import torch
from torch import nn

from towers.errors import FailedPreconditionError, InvalidTypeError

__all__ = ["compile_options", "compile_module"]

_COMPILERS = ("c++", "g++", "clang++")


def compile_options(compile: bool | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Return ``torch.compile`` keyword arguments for ``prepare``'s ``compile`` (None: do not compile).

    Raises:
        TypeError: when ``compile`` is neither a bool nor a mapping of ``torch.compile`` options.
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if isinstance(compile, Mapping):
        return dict(compile)
    raise InvalidTypeError(f"compile must be True, False or a dict of torch.compile options (e.g. {{'mode': "
                           f"'max-autotune'}}). Received: {compile!r}.")


def compile_module(module: nn.Module, options: Mapping[str, Any], device: torch.device) -> nn.Module:
    """Return ``torch.compile(module, **options)`` after checking that its backend can run on ``device``.

    Raises:
        RuntimeError: inductor on a CPU without a C++ compiler; the message names the ways on.
    """
    backend = options.get("backend", "inductor")
    if backend == "inductor" and device.type == "cpu" and not any(shutil.which(c) for c in _COMPILERS):
        raise FailedPreconditionError(
            "prepare(..., compile=True) needs a C++ compiler for torch.compile's default backend (inductor) on the "
            f"CPU, and none of {', '.join(_COMPILERS)} is on PATH. Install one (e.g. `apt-get install g++`), pass "
            "compile={'backend': 'aot_eager'} (traced, no C++ kernels), or leave compile=False.")
    return torch.compile(module, **options)  # type: ignore[return-value]
