"""The user's own model (and data) in ``towers bench --model module:factory``: found, built and checked once.

``module:factory`` names a callable that returns an ``nn.Module``; ``module`` is a module name
importable from the current directory (as ``python -m`` finds it) or a path to a ``.py`` file.
``--dataset module:factory`` likewise names a callable returning a dataset of ``(input, target)``
pairs; without it the benchmark feeds random inputs of ``--input-shape`` with random labels.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

from towers.errors import InvalidArgumentError, NotFoundError

__all__ = ["load_factory", "check_user_workload"]


def load_factory(ref: str, what: str = "--model") -> Callable[[], Any]:
    """Return the callable named by ``ref`` (``module:attr`` or ``path/to/file.py:attr``, attr may be dotted).

    Raises:
        ValueError: naming the reference, what went wrong and the expected form.
    """
    if not isinstance(ref, str) or ref.count(":") != 1 or not all(ref.split(":")):
        raise InvalidArgumentError(f"{what} must be 'module:factory' (e.g. mypkg.models:build_model) or "
                                   f"'path/to/file.py:factory'. Received: {ref!r}.")
    module_name, attr = ref.split(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            if not path.is_file():
                raise NotFoundError(f"no file {path}")
            spec = importlib.util.spec_from_file_location(f"towers_user_{path.stem}", path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path} as a module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # pickling and dataclasses look the module up by name
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` does: the user's own modules are found
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise InvalidArgumentError(f"{what} {ref!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc}). Run from the "
                                   "folder that holds it, or install its package, or pass a file path: "
                                   "path/to/file.py:factory.") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            names = sorted(n for n in dir(module) if not n.startswith("_"))[:12]
            raise InvalidArgumentError(f"{what} {ref!r}: {module_name!r} has no attribute {attr!r}. Public names there: {names}.")
        target = getattr(target, part)
    if not callable(target):
        raise InvalidArgumentError(f"{what} {ref!r} is a {type(target).__name__}, not a callable. Name a function or class "
                                   "that returns the object when called with no arguments.")
    return target


def check_user_workload(spec: Any) -> str:
    """Build the workload of ``spec`` (a ``WorkloadSpec``) once and run one forward pass and loss; return a summary.

    Raises:
        ValueError: when the factory fails, does not return an ``nn.Module``, the dataset is not
            ``(input, target)`` pairs, or the forward pass or loss fails on a batch (the message says which).
    """
    import torch

    model = spec.make_model()
    data = spec.make_raw_dataset(2)
    x, y = (torch.stack([data[i][0] for i in range(min(2, len(data)))]),
            torch.stack([torch.as_tensor(data[i][1]) for i in range(min(2, len(data)))]))
    try:
        out = model(x)
        loss = spec.loss_value(out, y)
        loss.backward()
    except Exception as exc:
        raise InvalidArgumentError(
            f"The model from {spec.model} fails on a batch of 2 inputs of shape {tuple(x.shape[1:])} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Pass the shape it takes with "
            "--input-shape C,H,W (and --num-classes), or your data with --dataset module:factory.") from exc
    params = sum(p.numel() for p in model.parameters())
    return (f"{spec.model}: {type(model).__name__}, {params:,} parameters, input {tuple(x.shape[1:])}, "
            f"output {tuple(out.shape[1:])}, loss {spec.loss}")
