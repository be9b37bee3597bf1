"""What the launcher says when a job fails or ends: the failed rank first, a start-up error's first line, the
workers tolerated and the replica groups restarted along the way."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from towers._logging import get_logger
from towers.launch.errors import LaunchError
from towers.launch.exits import describe_exit
from towers.launch.spec import LaunchSpec

__all__ = ["announce_first_failure", "failure_error", "restarted_text", "start_error", "tolerated_text"]

log = get_logger("towers.launch.launcher")  # the records keep the name they had in launcher.py


def _exit_code(exitcode: int) -> int:
    if exitcode < 0:
        return 128 + (-exitcode)
    return exitcode if 0 < exitcode < 256 else 1


def failure_error(exc: Any, spec: LaunchSpec) -> LaunchError:
    # torchrun's agent notes failures in the order it sees them: the ones that ended the job (those of its first
    # poll), then the survivors it ended itself (SIGTERM, SIGKILL after shutdown_timeout). So the cause is the first
    # one noted, signal or not (a SIGTERM sent to a ps task is the cause; the workers' SIGTERMs that follow are not).
    # torch's timestamps are whole seconds, and a signal death's is when the agent noted it: no finer order.
    failures = list(exc.failures.items())
    first_rank, first = failures[0]
    text = (f"rank {first_rank} (local rank {first.local_rank}, pid {first.pid}) {describe_exit(first.exitcode)}; "
            "towers launch stopped every other process of the job on this node")
    if len(failures) > 1:
        others = ", ".join(f"rank {rank} {describe_exit(f.exitcode)}" for rank, f in failures[1:])
        text += f" ({others})"
    text += f". Command: {' '.join(spec.command())}"
    message = getattr(first, "message", "")
    if isinstance(message, str) and message and not message.startswith("To enable traceback"):
        text += f"\nrank {first_rank} reported: {message}"
    return LaunchError(text, exit_code=_exit_code(first.exitcode), failed_rank=first_rank)


def announce_first_failure(exc: Any, spec: LaunchSpec) -> None:
    # The other nodes' processes still in start-up would wait for this node's dead rank in torch's C++ until their
    # timeout: the job's store tells them (towers.cluster.deaths), so they stop at once naming it. On one host they
    # see its pid gone. The job ended after its last attempt, so that is the one told.
    if spec.is_single_node or spec.rdzv_backend != "static" or spec.master_port is None:
        return
    rank, first = next(iter(exc.failures.items()))
    try:
        from towers.process_group import announce_deaths  # torch: only once the job failed

        announce_deaths(spec.master_addr, spec.master_port, {rank: describe_exit(first.exitcode)},
                        attempt=spec.max_restarts)
    except Exception as store_error:  # noqa: BLE001 - node 0 (and its store) may be gone: the others time out
        log.debug("could not tell the other nodes that rank %s died: %s", rank, store_error)


def start_error(exc: BaseException, rendezvous: str, spec: LaunchSpec, join_timeout_s: float) -> LaunchError:
    # torch's text can carry a page of C++ frames: the first line goes to the user, the rest to a file.
    import traceback

    from towers.process_group import first_line

    path = os.path.join(tempfile.gettempdir(), "towers-logs", f"launch-pid{os.getpid()}.log")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write("".join(traceback.format_exception(exc)))
        detail = f" (torch's full message: {path})"
    except OSError:
        detail = ""
    if type(exc).__name__ == "RendezvousTimeoutError":
        nodes = spec.min_nodes if spec.min_nodes == spec.max_nodes else f"{spec.min_nodes} to {spec.max_nodes}"
        return LaunchError(
            f"Not all of the {nodes} nodes joined torchrun's {spec.rdzv_backend} rendezvous at {rendezvous} within the "
            f"join timeout of {join_timeout_s:g} s. Check that `towers launch` runs on every node with the same "
            f"--nnodes, --rdzv-backend, --rdzv-endpoint and --rdzv-id, that each node reaches {rendezvous}, or "
            f"raise --join-timeout.{detail}")
    return LaunchError(
        f"The job could not start: {type(exc).__name__}: {first_line(exc)}. Check that every node reaches the "
        f"rendezvous {rendezvous} and that --nnodes/--node-rank agree across nodes.{detail}")


def restarted_text(report_dir: str | None) -> list[str]:
    """Return one phrase per replica group that its supervisor restarted alone."""
    if report_dir is None:
        return []
    from towers.launch.replica_group import read_restarts

    by_rank: dict[Any, list[str]] = {}
    for report in read_restarts(report_dir):
        by_rank.setdefault(report.get("rank"), []).append(str(report.get("description")))
    return [f"replica group {rank} was restarted alone {len(why)} time(s) (it {'; then '.join(why)})"
            for rank, why in by_rank.items()]


def tolerated_text(report_dir: str | None) -> list[str]:
    """Return one phrase per non-chief worker whose failure the supervisors hid from the agent."""
    if report_dir is None:
        return []
    # Imported here, not at the top: `python -m towers.launch.supervise` must not find it imported already.
    from towers.launch.supervise import read_reports

    return [f"worker rank {r.get('rank')} (local rank {r.get('local_rank')}) {r.get('description')}"
            for r in read_reports(report_dir)]
