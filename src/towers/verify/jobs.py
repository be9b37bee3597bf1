"""Starting the runs of ``towers verify``: one process, or N replicas with torchrun's variables, each under the runner.

All runs of one verification start together (each on its own port) and share the host's cores; each
process's output goes to a file in its capture directory. The first rank that fails stops its run's
other ranks (they would wait in a collective until the process group's timeout), and every process
is gone when ``run_all`` returns.
"""

from __future__ import annotations

import ast
import operator
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from towers.cluster.detect import VERIFY_DIR_VARIABLE, VERIFY_STEPS_VARIABLE
from towers.cluster.environ import read_environ
from towers.cluster.strategy_options import ENV as OPTIONS_ENV
from towers.cluster.strategy_options import encode_strategy_options
from towers.errors import InvalidArgumentError, user_error
from towers.launch.spawn import cpu_threads_per_process, free_port

__all__ = ["RunSpec", "RunResult", "format_args", "run_all"]

#: Variables that would make the one-process run join some other job.
_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TF_CONFIG", "TOWERS_STRATEGY",
                  "TOWERS_NUM_PS", "TOWERS_STRATEGY_OPTIONS", "TOWERS_LAUNCH_DIR")
_GRACE_S = 3.0  # after one rank failed, how long the others get to fail on their own (their error says more)


@dataclass(frozen=True)
class RunSpec:
    """One run: ``strategy`` (None: a plain script) on ``replicas`` processes, its capture in ``directory``."""

    label: str
    strategy: str | None
    replicas: int
    directory: str
    args: tuple[str, ...]


@dataclass(frozen=True)
class RunResult:
    """How a run ended: each rank's exit code and, when one failed, the end of its error output."""

    spec: RunSpec
    exit_codes: tuple[int | None, ...]
    error: str | None
    seconds: float


_OPS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                         ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv}


def _evaluate(node: ast.AST, world_size: int) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, world_size)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name) and node.id in ("world_size", "replicas"):
        return world_size
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, world_size), _evaluate(node.right, world_size))
    raise InvalidArgumentError("not an arithmetic expression of world_size")


def format_args(args: Sequence[str], world_size: int) -> tuple[str, ...]:
    """Fill ``{...}`` in ``args`` for a run on ``world_size`` processes: ``{world_size}``, ``{64 // world_size}``.

    Raises:
        ValueError: when an expression does not give a whole number.
    """
    def fill(match: re.Match[str]) -> str:
        try:
            value = _evaluate(ast.parse(match.group(1), mode="eval"), world_size)
        except (SyntaxError, ValueError, ZeroDivisionError):
            return match.group(0)  # not ours: left as written
        if value != int(value):
            raise user_error(f"script argument {match.group(0)} must give a whole number on every run",
                             f"{value} for world_size={world_size}",
                             "Use a global batch that the replica counts divide, or `//`.")
        return str(int(value))

    return tuple(re.sub(r"\{([^{}]+)\}", fill, arg) for arg in args)


def _child_env(spec: RunSpec, rank: int, *, port: int, steps: int, threads: int, plain: bool,
               base: Mapping[str, str], options: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in _JOB_VARIABLES}
    if options is not None:
        env[OPTIONS_ENV] = options
    env.update({VERIFY_DIR_VARIABLE: spec.directory, VERIFY_STEPS_VARIABLE: str(steps),
                "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"})
    if spec.strategy is not None:
        env["TOWERS_STRATEGY"] = spec.strategy
    if spec.replicas > 1 or plain:  # a plain script may need torchrun's variables even alone
        env.update({"RANK": str(rank), "WORLD_SIZE": str(spec.replicas), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(spec.replicas), "GROUP_RANK": "0", "NODE_RANK": "0",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    return env


def _error_text(path: str, limit: int = 4000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return ""
    return text[-limit:].strip()


def _kill(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def run_all(specs: Sequence[RunSpec], *, script: str, steps: int, plain: bool, keep_dropout: bool,
            timeout_s: float, strategy_options: Mapping[str, Any] | None = None) -> list[RunResult]:
    """Run every spec at once under the runner and return how each ended (in order); no process outlives the call.

    ``strategy_options``: given to every run's strategy (``TOWERS_STRATEGY_OPTIONS``; the caller's own is never
    passed on, as no job variable of the caller's is).
    """
    base = read_environ()
    options = encode_strategy_options(strategy_options) if strategy_options else None
    threads = cpu_threads_per_process(sum(s.replicas for s in specs))
    runner = [sys.executable, "-m", "towers.verify.runner", *(["--plain"] if plain else []),
              *(["--keep-dropout"] if keep_dropout else [])]
    started = time.monotonic()
    running: list[list[subprocess.Popen[bytes]]] = []
    try:
        for spec in specs:
            os.makedirs(spec.directory, exist_ok=True)
            port = free_port()
            procs = []
            for rank in range(spec.replicas):
                log = os.path.join(spec.directory, f"output{rank}.txt")
                with open(log, "wb") as out:
                    procs.append(subprocess.Popen(
                        [*runner, script, *spec.args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                        env=_child_env(spec, rank, port=port, steps=steps, threads=threads, plain=plain, base=base,
                                       options=options),
                        start_new_session=True))
            running.append(procs)
        return [_wait(spec, procs, started + timeout_s, started) for spec, procs in zip(specs, running)]
    finally:
        for procs in running:
            _kill(procs)


def _wait(spec: RunSpec, procs: Sequence[subprocess.Popen[bytes]], deadline: float, started: float) -> RunResult:
    failed_at: float | None = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if any(p.returncode not in (None, 0) for p in procs) and failed_at is None:
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + _GRACE_S):
            break
        time.sleep(0.05)
    timed_out = any(p.poll() is None for p in procs) and failed_at is None
    _kill(procs)
    codes = tuple(p.returncode for p in procs)
    error = None
    failing = [r for r, p in enumerate(procs) if p.returncode not in (0, None) and p.returncode >= 0]
    if timed_out:
        error = f"the run did not finish within {deadline - started:.0f} s (a rank may wait in a collective)"
    elif failing:
        error = _error_text(os.path.join(spec.directory, f"output{failing[0]}.txt"))
    elif any(c != 0 for c in codes):
        error = f"ranks ended with exit codes {list(codes)}"
    return RunResult(spec, codes, error, time.monotonic() - started)
