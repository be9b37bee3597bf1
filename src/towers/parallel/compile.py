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

__all__ = ["compile_options", "compile_module", "CompiledModules"]

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


class CompiledModules:
    """The modules a strategy's ``prepare`` compiled, each under its compiled form (``strategy.unwrap`` sees through it)."""

    def __init__(self) -> None:
        self._originals: dict[int, nn.Module] = {}  # id(compiled module) -> the module it compiles

    def compile(self, module: nn.Module, compile: bool | Mapping[str, Any], device: torch.device) -> nn.Module:
        """Return ``module`` compiled as ``prepare(..., compile=)`` asks (``module`` itself when it does not)."""
        options = compile_options(compile)
        if options is None:
            return module
        compiled = compile_module(module, options, device)
        self._originals[id(compiled)] = module
        return compiled

    def original(self, module: nn.Module) -> nn.Module:
        """The module ``module`` compiles, when it is one compiled here; else ``module``."""
        return self._originals.get(id(module), module)
