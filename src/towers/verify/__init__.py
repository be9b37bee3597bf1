"""``towers verify``: is my distributed run the run I meant? The same script, one process vs N replicas, update by update.

The script runs unchanged for a few updates as one process and under each strategy at each replica
count (``jobs.py``, through ``runner.py``); every update through the prepared optimizer records the
parameters (``towers.verify_capture``); ``compare.py`` finds the first step at which a run leaves the
one-process run and gathers what it saw, and ``causes.py`` names the likely reason.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field

from towers.cluster import roles
from towers.errors import FailedPreconditionError, user_error
from towers.verify.causes import CAUSES, Cause, name_cause
from towers.verify.compare import DEFAULT_TOLERANCE, Evidence, gather_evidence, load_capture, worst_difference
from towers.verify.jobs import RunResult, RunSpec, format_args, run_all

__all__ = ["VerifySpec", "VerifyRow", "VerifyReport", "verify", "CAUSES", "Cause", "name_cause", "Evidence",
           "DEFAULT_TOLERANCE"]


@dataclass(frozen=True, kw_only=True)
class VerifySpec:
    """What to verify: ``script`` (and its ``args``) for ``steps`` updates under each strategy at each replica count.

    Args:
        script: the training script's path.
        args: its arguments; ``{world_size}`` or ``{64 // world_size}`` in them is filled for each run.
        strategies: the strategies to run it under (``--strategies``).
        replicas: the replica counts (``--replicas``).
        steps: the optimizer updates compared.
        plain: a script without towers (torch DDP reading ``RANK``/``WORLD_SIZE``), run with torchrun's
            variables.
        keep_dropout: leave dropout on (runs then differ by design).
        tolerance: the largest difference relative to a tensor's scale counted as rounding.
        timeout_s: the seconds all runs may take together.
        workdir: where the captures and each process's output are kept; None: a temporary directory, removed
            at the end.
        bitwise: every run under ``bitwise=True`` with this ``micro_batch_size``, compared with ``torch.equal``
            (``--bitwise M``).

    Raises:
        ValueError: no such script, or a value out of range (each with its fix).
    """

    script: str
    args: tuple[str, ...] = ()
    strategies: tuple[str, ...] = ("mirrored", "sharded")
    replicas: tuple[int, ...] = (2,)
    steps: int = 5
    plain: bool = False
    keep_dropout: bool = False
    tolerance: float = DEFAULT_TOLERANCE
    timeout_s: float = 300.0
    #: Where the captures and each process's output are kept; None: a temporary directory, removed at the end.
    workdir: str | None = None
    #: Every run under ``bitwise=True`` with this ``micro_batch_size``, compared with ``torch.equal`` (``--bitwise M``).
    bitwise: int | None = None

    def __post_init__(self) -> None:
        if not os.path.isfile(self.script):
            raise user_error("towers verify needs a Python script to run", repr(self.script),
                             "Pass the path of your training script: `towers verify train.py`.")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise user_error("--steps must be a positive number of updates", repr(self.steps), "Use e.g. --steps 5.")
        if not self.replicas or any(n < 2 for n in self.replicas):
            raise user_error("--replicas must list replica counts of 2 or more", repr(list(self.replicas)),
                             "Use e.g. --replicas 2 or --replicas 2,3 (the one-process run is always made).")
        if not self.plain and not self.strategies:
            raise user_error("--strategies must name at least one strategy", "none", "Use e.g. --strategies mirrored.")
        known = [e.name for e in roles.STRATEGIES if e.multi_process]
        for name in () if self.plain else self.strategies:
            entry = next((e for e in roles.STRATEGIES if name in (e.name, *e.aliases)), None)
            if entry is None or not entry.multi_process:
                what = ("Unknown strategy in --strategies" if entry is None else
                        "--strategies takes strategies of several replicas (the one-process run is always made)")
                raise user_error(what, repr(name), f"Use some of {', '.join(known)} (comma-separated), e.g. "
                                 "--strategies mirrored,sharded.")
        if not self.timeout_s > 0 or self.timeout_s == float("inf"):
            raise user_error("--timeout must be a number of seconds > 0 (all runs together)", repr(self.timeout_s),
                             "Use e.g. --timeout 300 (the default).")
        if not self.tolerance > 0:
            raise user_error("--tolerance must be > 0", repr(self.tolerance), "Use e.g. --tolerance 1e-3.")
        if self.bitwise is not None:
            _check_bitwise(self)


def _check_bitwise(spec: VerifySpec) -> None:
    """Refuse what ``--bitwise`` cannot compare: a plain script, a strategy that does not train bit for bit, no size."""
    m = spec.bitwise
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise user_error("--bitwise takes the micro-batch size every run cuts its global batches into", repr(m),
                         "Use e.g. --bitwise 4 (a size that divides each global batch into equal shares at every "
                         "replica count compared).")
    if spec.plain:
        raise user_error("--bitwise runs the script under towers' bitwise=True; a plain script has no towers strategy",
                         "--plain with --bitwise", "Drop --plain, or compare a plain script without --bitwise.")
    takers = [e.name for e in roles.STRATEGIES if e.multi_process and e.name in ("mirrored", "multi_worker_mirrored",
                                                                                  "sharded")]
    wrong = [s for s in spec.strategies if s not in takers]
    if wrong:
        raise user_error("--bitwise compares the strategies that train bit for bit", f"--strategies {','.join(wrong)}",
                         f"Use --strategies {takers[0]} (bitwise=True is built for {', '.join(takers)}).")


@dataclass(frozen=True)
class VerifyRow:
    """One line of the table: a strategy at a replica count against the one-process run.

    Attributes:
        strategy: the strategy.
        replicas: the replica count.
        steps: the updates compared.
        verdict: ``"same"``, ``"DIFFERS"`` or ``"FAILED"``.
        first_step: the first update that differs (None: none).
        tensor: the tensor that differs most there.
        relative: its difference relative to its scale.
        cause: the known cause that fits, with its fix (None: none fits).
        detail: the evidence, in words.
    """

    strategy: str
    replicas: int
    steps: int
    verdict: str  # "same", "DIFFERS" or "FAILED"
    first_step: int | None = None
    tensor: str = "-"
    relative: float | None = None
    cause: Cause | None = None
    detail: str = ""


@dataclass(frozen=True)
class VerifyReport:
    """The whole verification: its rows, how long it took, and the one-process run's error if it failed.

    Attributes:
        script: the script verified.
        steps: the updates compared.
        rows: one per strategy and replica count.
        seconds: how long all runs took.
        reference_error: the one-process run's error (None: it ran).
        notes: lines printed after the table.
    """

    script: str
    steps: int
    rows: tuple[VerifyRow, ...]
    seconds: float
    reference_error: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True when every run matched the one-process run."""
        return self.reference_error is None and all(r.verdict == "same" for r in self.rows)

    def format(self) -> str:
        """Return the report as the command prints it: a table, then the cause and fix of each difference."""
        if self.reference_error is not None:
            return (f"towers verify {self.script}: the one-process run gave nothing to compare:\n"
                    f"{self.reference_error}\ntime: {self.seconds:.1f} s")
        header = ("strategy", "replicas", "steps compared", "first diverging step", "tensor", "max rel. diff", "verdict")
        lines = [header] + [(r.strategy, str(r.replicas), str(r.steps), "-" if r.first_step is None else str(r.first_step),
                             r.tensor, "-" if r.relative is None else f"{r.relative:.1e}", r.verdict) for r in self.rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        out = [f"towers verify {self.script}: {self.steps} update(s), one process vs each run (dropout off)"]
        out += ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
        for row in self.rows:
            if row.verdict == "same":
                continue
            where = f"{row.strategy} x{row.replicas}"
            if row.cause is not None:
                out.append(f"{where}: likely cause: {row.cause.title} [{row.cause.key}]. Fix: {row.cause.fix}.")
            else:
                out.append(f"{where}: no known cause fits; look at {row.tensor} at step {row.first_step}.")
            if row.detail:
                out.append(f"  {row.detail}")
        out += [f"note: {n}" for n in self.notes]
        out.append(f"time: {self.seconds:.1f} s")
        return "\n".join(out)


def _row(label: str, result: RunResult, reference_dir: str, *, replicas: int, tolerance: float) -> VerifyRow:
    reference = load_capture(os.path.join(reference_dir, "rank0"))
    if reference is None:  # checked by the caller
        raise FailedPreconditionError("the one-process run recorded nothing")
    ranks = [load_capture(os.path.join(result.spec.directory, f"rank{r}")) for r in range(replicas)]
    evidence = gather_evidence(reference, ranks, replicas=replicas, error=result.error, tolerance=tolerance)
    cause = name_cause(evidence)
    error_line = _last_error_line(result.error)
    if ranks[0] is None or result.error is not None:
        return VerifyRow(label, replicas, evidence.updates, "FAILED", cause=cause,
                         detail=error_line or "no update went through the prepared optimizer")
    diff = evidence.difference
    if diff is None:
        worst = worst_difference(reference.steps, ranks[0].steps, reference.names)
        return VerifyRow(label, replicas, evidence.updates, "same", relative=worst.relative if worst else 0.0)
    detail = _describe(evidence)
    return VerifyRow(label, replicas, evidence.updates, "DIFFERS", first_step=diff.step, tensor=diff.tensor,
                     relative=diff.relative, cause=cause, detail=detail)


def _last_error_line(error: str | None) -> str:
    if not error:
        return ""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    chosen = next((line for line in reversed(lines) if "Error" in line.split(":", 1)[0]), lines[-1] if lines else "")
    if len(chosen) > 300:  # the refusal's first sentences: the cause and fix lines say the rest
        cut = chosen.rfind(". ", 0, 300)
        chosen = chosen[:cut + 1 if cut > 0 else 300] + " ..."
    return chosen


def _describe(e: Evidence) -> str:
    parts = []
    if e.delta_ratio is not None:
        parts.append(f"update {e.difference.step if e.difference else '?'}: |update| = {e.delta_ratio:.3g} x one "
                     f"process's (cosine {e.cosine:.3f})")
    if e.replica_drift_step is not None:
        parts.append(f"replicas differ from replica 0 from step {e.replica_drift_step}")
    if e.reference_examples and e.run_examples:
        n = min(len(e.reference_examples), len(e.run_examples), max(e.updates, 1), 8)
        parts.append(f"examples per update: one process {list(e.reference_examples[:n])}, "
                     f"all replicas {list(e.run_examples[:n])}")
    return "; ".join(parts)


def verify(spec: VerifySpec) -> VerifyReport:
    """Run ``spec.script`` as one process and under every strategy and replica count; compare the parameters.

    Args:
        spec: what to run and compare.

    Returns:
        The report: ``report.ok`` when every run matched, ``report.format()`` the table ``towers verify``
        prints.

    Example:
        <!-- not-run: starts the script once per strategy and replica count (about a minute on a laptop) -->
        ```python
        from towers.verify import VerifySpec, verify

        report = verify(VerifySpec(script="train.py", strategies=("mirrored",), replicas=(2,), steps=3))
        print(report.format())
        ```
    """
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="towers-verify-") as scratch:
        root = spec.workdir or scratch
        reference = RunSpec("one process", None if spec.plain else "one_device", 1, os.path.join(root, "one_process"),
                            format_args(spec.args, 1))
        runs = []
        for name in (("plain",) if spec.plain else spec.strategies):
            for n in spec.replicas:
                runs.append(RunSpec(name, None if spec.plain else name, n, os.path.join(root, f"{name}_x{n}"),
                                    format_args(spec.args, n)))
        options = None if spec.bitwise is None else {"bitwise": "true", "micro_batch_size": spec.bitwise}
        results = run_all([reference, *runs], script=spec.script, steps=spec.steps, plain=spec.plain,
                          keep_dropout=spec.keep_dropout, timeout_s=spec.timeout_s, strategy_options=options)
        ref_capture = load_capture(os.path.join(reference.directory, "rank0"))
        if results[0].error is not None or ref_capture is None:
            return VerifyReport(spec.script, spec.steps, (), time.monotonic() - started,
                                reference_error=results[0].error or (
                                    "the script made no update through an optimizer (under towers: the optimizer "
                                    "strategy.prepare returned; with --plain: any torch.optim optimizer)"))
        tolerance = 0.0 if spec.bitwise is not None else spec.tolerance  # bit for bit: any difference is one
        rows = tuple(_row(r.spec.label, r, reference.directory, replicas=r.spec.replicas, tolerance=tolerance)
                     for r in results[1:])
        notes = [] if spec.bitwise is None else [
            f"bit for bit (bitwise=True, micro_batch_size={spec.bitwise}): every parameter after every update compared "
            "with torch.equal; a difference is any bit"]
        if ref_capture.updates < spec.steps:
            notes.append(f"the script made {ref_capture.updates} update(s) as one process, fewer than --steps "
                         f"{spec.steps}: only those were compared")
        return VerifyReport(spec.script, spec.steps, rows, time.monotonic() - started, notes=tuple(notes))
