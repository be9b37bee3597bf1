"""Fixtures for every test."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

# A strategy built in the pytest process itself (a one-host process group, a fault-tolerant group) exports the
# loopback interface for Gloo/NCCL into os.environ, as it does in a real job. A later test that starts a job spanning
# two "hosts" from this process would hand it on to the job, so each test gets back the environment it started with.
_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@pytest.fixture(autouse=True)
def _collective_interfaces_restored() -> Iterator[None]:
    before = {name: os.environ.get(name) for name in _INTERFACE_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _no_strategy_left_current() -> Iterator[None]:
    """A loop without ``strategy.run`` leaves its last step's strategy and replica context current, as a script's loop
    does (its step lasts until the next forward). In one pytest process that would reach the next test: each test
    starts and ends with none."""
    from towers.strategies import context

    variables = (context.CURRENT_STRATEGY, context.CURRENT_REPLICA)
    for variable in variables:
        variable.set(None)
    yield
    for variable in variables:
        variable.set(None)


@pytest.fixture(autouse=True)
def _deterministic_mode_restored() -> Iterator[None]:
    """A strategy built with ``bitwise=True`` turns on torch's deterministic kernels for its process, as it should in a
    script; in one pytest process that would reach the next test."""
    import torch

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
