"""Act on a ``LaunchSpec``: check it can start, then run it under ``torch.distributed.elastic``.

torchrun's agent does the work (rendezvous, one process per replica, restarts, torchrun's
variables). This module adds what ``towers launch`` promises on top:

- a free loopback port when a single-node job names none (torchrun's 29500 across nodes);
- ``TOWERS_STRATEGY``/``TOWERS_NUM_PS`` and ``OMP_NUM_THREADS`` = cores // processes in every
  worker's environment (``LaunchSpec.worker_environment``);
- checks before anything starts: the script exists, the rendezvous port is free;
- across nodes, towers' own join before torchrun's (``towers.launch.nodes``): node 0 says every
  ~15 s which nodes joined and which are missing, and the job stops at the join timeout
  (``--join-timeout`` / ``TOWERS_JOIN_TIMEOUT_S``) with one line; a rendezvous host that does not
  resolve or answer stops it at once. torchrun's own waits are bounded by the same timeout;
- a failure report naming the failed rank. The agent polls every ``monitor_interval_s``; on the
  first failed worker it sends SIGTERM to every other worker (SIGKILL after ``shutdown_timeout``,
  torchrun's default 30 s) and waits for them, so no process is left behind;
- under ``--strategy ps`` (``spec.tolerate_worker_failures``), every process runs under
  ``towers.launch.supervise``, which hides a non-chief worker's failure from the agent (exit 0), so
  an async job finishes with the other workers; the launcher then names each such worker and its
  exit code at the end (and in the error, when the job fails later for another reason);
- under ``--strategy fault_tolerant`` (``spec.restarts_lost_replica``), node 0 runs the job's torchft
  lighthouse in this process (``start_job_lighthouse``; none when ``TORCHFT_LIGHTHOUSE`` or
  ``--strategy-option lighthouse=`` names one) and every worker gets its address in
  ``TORCHFT_LIGHTHOUSE``; the agent starts one ``towers.launch.replica_group`` per replica group
  (``--group-size`` processes each), which starts the group's processes and restarts them together,
  alone, when one dies (``--group-restarts``), while the other groups train on; the launcher lists
  the restarts at the end;
- each worker's output reaches the terminal in whole lines prefixed ``[rank N]: `` (``towers.launch.output``;
  torchrun's ``--tee``, ``--redirects``, ``--local-ranks-filter`` and ``--log-dir`` choose what is shown);
- no process outlives the launcher (``towers.launch.parent_death``): every worker dies with it
  (``PR_SET_PDEATHSIG``), and a stop signal also continues stopped workers, so they act on it;
- under ``--strategy X``, a job whose script never built a towers strategy ends with one warning
  that X was not used and how to use it: each worker finds a directory of this launcher's in
  ``TOWERS_LAUNCH_DIR`` (``ProcessInfo.launch_dir``), and a strategy leaves a note there when it is
  built (``towers.cluster.launch_notes``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import ipaddress
import os
import shutil
import signal
import socket
import tempfile
from typing import Any, Mapping

from towers._logging import get_logger
from towers.cluster import ClusterConfigError, environ_overrides, read_environ, read_join_timeout
from towers.cluster.launch_notes import LAUNCH_DIR_VARIABLE, strategies_built
from towers.cluster.rendezvous import RendezvousError, visible_warning
from towers.launch.exits import describe_exit
from towers.launch.spawn import free_port
from towers.launch.spec import LaunchSpec

__all__ = ["LaunchError", "launch", "resolve_ports", "preflight", "job_lighthouse", "DEFAULT_MULTI_NODE_PORT",
           "DEFAULT_LIGHTHOUSE_PORT"]

log = get_logger(__name__)

#: torchrun's rendezvous port across nodes when none is given.
DEFAULT_MULTI_NODE_PORT = 29500
#: Port of the fault-tolerant job's lighthouse on node 0 across nodes (``TOWERS_LIGHTHOUSE_PORT`` changes it);
#: on one node it is a free port.
DEFAULT_LIGHTHOUSE_PORT = 29510


class LaunchError(RuntimeError):
    """The job could not start, or a worker failed; ``exit_code`` is what ``towers launch`` exits with."""

    def __init__(self, message: str, *, exit_code: int = 1, failed_rank: int | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.failed_rank = failed_rank


def resolve_ports(spec: LaunchSpec) -> LaunchSpec:
    """Return ``spec`` with its rendezvous port chosen: a free loopback port on one node, 29500 across nodes."""
    if spec.master_port is not None or spec.rdzv_backend != "static" or spec.rdzv_endpoint:
        return spec
    port = free_port(spec.master_addr) if spec.is_single_node else DEFAULT_MULTI_NODE_PORT
    return dataclasses.replace(spec, master_port=port)


def _check_script(spec: LaunchSpec) -> None:
    if spec.module:
        if not all(part.isidentifier() for part in spec.script.split(".")):
            raise LaunchError(f"-m/--module expects a dotted module name such as 'pkg.train'. Received: "
                              f"{spec.script!r}. Drop -m to run a file.", exit_code=2)
        return
    if spec.no_python and not spec.run_path:
        if shutil.which(spec.script) is None:
            raise LaunchError(
                f"--no-python runs {spec.script!r} directly, but no such executable was found (on PATH or as a "
                "path). Check the name, make the file executable, or drop --no-python for a Python script.",
                exit_code=2)
        return
    if not os.path.isfile(spec.script):
        hint = " It is a directory; name the .py file inside it." if os.path.isdir(spec.script) else ""
        raise LaunchError(
            f"Training script not found: {spec.script!r} (looked in {os.getcwd()}).{hint} Pass the path of a "
            "Python file, `-m pkg.module` for a module, or `--no-python` for an executable.", exit_code=2)


def _check_port(spec: LaunchSpec) -> None:
    # Node 0 of a static rendezvous binds master_addr:master_port; a busy port would otherwise
    # surface as a DistNetworkError from deep inside the agent.
    if spec.rdzv_backend != "static" or spec.node_rank != 0 or spec.master_port is None:
        return
    family = socket.AF_INET6 if ":" in spec.master_addr.strip("[]") else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((spec.master_addr.strip("[]"), spec.master_port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise LaunchError(
                f"Port {spec.master_port} on {spec.master_addr} is already in use, so the rendezvous cannot start "
                "there. Pick another --master-port, or omit it on a single node to get a free one.",
                exit_code=2) from None
        # Not an address of this host (or not resolvable here): node 0 is elsewhere; nothing to check.


def preflight(spec: LaunchSpec) -> None:
    """Check, before starting any process, that the script exists and the rendezvous port is free.

    Raises:
        LaunchError: naming what is missing or busy and how to fix it.
    """
    _check_script(spec)
    _check_port(spec)
    if spec.node_rank == 0:  # node 0 hosts the job's store: one connection per process of the job
        from towers.launch.limits import check_host_limits

        check_host_limits(spec.nproc_per_node * spec.max_nodes)


def _torchrun_namespace(spec: LaunchSpec) -> Any:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args([spec.script])  # this torch version's defaults for every option
    for key, value in spec.torchrun_options.items():
        setattr(args, key, value)
    args.training_script = spec.script
    args.training_script_args = list(spec.script_args)
    args.module, args.no_python = spec.module, spec.no_python
    if hasattr(args, "run_path"):
        args.run_path = spec.run_path
    # Under --strategy fault_tolerant the agent starts one supervisor per replica group, which starts its processes.
    args.nproc_per_node = str(spec.nproc_per_node // spec.group_size)
    args.nnodes = f"{spec.min_nodes}:{spec.max_nodes}"
    args.node_rank = spec.node_rank
    args.master_addr, args.master_port = spec.master_addr, spec.master_port
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = spec.rdzv_backend, spec.rdzv_endpoint, spec.rdzv_id
    args.standalone = False  # already folded into the rdzv_* fields by spec_from_args
    args.max_restarts = spec.max_restarts
    args.monitor_interval = spec.monitor_interval_s
    return args


def _exit_code(exitcode: int) -> int:
    if exitcode < 0:
        return 128 + (-exitcode)
    return exitcode if 0 < exitcode < 256 else 1


def _failure_error(exc: Any, spec: LaunchSpec) -> LaunchError:
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


def _announce_first_failure(exc: Any, spec: LaunchSpec) -> None:
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


def _start_error(exc: BaseException, rendezvous: str, spec: LaunchSpec, join_timeout_s: float) -> LaunchError:
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


def _restarted_text(report_dir: str | None) -> list[str]:
    """Return one phrase per replica group that its supervisor restarted alone."""
    if report_dir is None:
        return []
    from towers.launch.replica_group import read_restarts

    by_rank: dict[Any, list[str]] = {}
    for report in read_restarts(report_dir):
        by_rank.setdefault(report.get("rank"), []).append(str(report.get("description")))
    return [f"replica group {rank} was restarted alone {len(why)} time(s) (it {'; then '.join(why)})"
            for rank, why in by_rank.items()]


def _tolerated_text(report_dir: str | None) -> list[str]:
    """Return one phrase per non-chief worker whose failure the supervisors hid from the agent."""
    if report_dir is None:
        return []
    # Imported here, not at the top: `python -m towers.launch.supervise` must not find it imported already.
    from towers.launch.supervise import read_reports

    return [f"worker rank {r.get('rank')} (local rank {r.get('local_rank')}) {r.get('description')}"
            for r in read_reports(report_dir)]


def _peer_timeout_s(spec: LaunchSpec) -> float:
    from towers.launch.lighthouse import DEFAULT_PEER_TIMEOUT_S

    value = spec.strategy_options.get("peer_timeout_s", DEFAULT_PEER_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise LaunchError(f"--strategy-option peer_timeout_s must be a positive number of seconds. Received: {value!r}. "
                          "Example: --strategy-option peer_timeout_s=5.", exit_code=2)
    return float(value)


@contextlib.contextmanager
def job_lighthouse(spec: LaunchSpec, environ: Mapping[str, str]) -> Any:
    """Yield the lighthouse address a fault-tolerant job's workers use, running the lighthouse here on node 0.

    None is yielded when the job names its own (``TORCHFT_LIGHTHOUSE``, ``--strategy-option lighthouse=``).
    On one node the lighthouse gets a free port of ``--master-addr``; across nodes it listens on node 0's
    ``--master-addr`` at ``TOWERS_LIGHTHOUSE_PORT`` (default 29510), where the other nodes look for it.

    Raises:
        LaunchError: when torchft is missing, the port is not a number, or the lighthouse cannot start.
    """
    if spec.strategy_options.get("lighthouse") or environ.get("TORCHFT_LIGHTHOUSE", "").strip():
        yield None
        return
    text = environ.get("TOWERS_LIGHTHOUSE_PORT", "").strip()
    if spec.is_single_node and not text:
        port = free_port(spec.master_addr)
    else:
        try:
            port = int(text or DEFAULT_LIGHTHOUSE_PORT)
            if not 0 < port < 65536:
                raise ValueError
        except ValueError:
            raise LaunchError(f"TOWERS_LIGHTHOUSE_PORT must be a port number in 1..65535. Received: {text!r}. "
                              f"Unset it for {DEFAULT_LIGHTHOUSE_PORT}.", exit_code=2) from None
    host = spec.master_addr.strip("[]")
    url_host = f"[{host}]" if ":" in host else host
    if spec.node_rank != 0:  # node 0 runs it
        yield f"http://{url_host}:{port}"
        return
    from towers.launch.lighthouse import start_lighthouse
    from towers.network import NetworkError, resolve_ipv4

    peer_timeout_s = _peer_timeout_s(spec)
    try:
        bind = host if ":" in host else resolve_ipv4(host)
        if spec.interface:
            from towers.network import find_interface

            bind = find_interface(spec.interface).address or bind
        elif not spec.is_single_node and ipaddress.ip_address(bind).is_loopback:
            bind = "0.0.0.0"  # this host maps its own name to loopback (Debian's 127.0.1.1): listen where others reach
        lighthouse = start_lighthouse(bind, port, peer_timeout_s=peer_timeout_s)
    except ImportError as exc:
        raise LaunchError(str(exc), exit_code=2) from None
    except NetworkError as exc:
        raise LaunchError(f"--master-addr {spec.master_addr}: {exc}", exit_code=2) from None
    except Exception as exc:  # torchft's bind error (a RuntimeError from its Rust side)
        raise LaunchError(f"The job's torchft lighthouse could not start on {host}:{port}: {type(exc).__name__}: "
                          f"{exc}. Pick another port (TOWERS_LIGHTHOUSE_PORT) or start one yourself and pass "
                          "--strategy-option lighthouse=http://HOST:PORT.", exit_code=2) from None
    log.info("fault-tolerant job: lighthouse on %s:%d (peer_timeout_s=%s)", host, port, peer_timeout_s)
    try:
        yield f"http://{url_host}:{port}"
    finally:
        lighthouse.shutdown()


def launch(spec: LaunchSpec, *, environ: Mapping[str, str] | None = None) -> None:
    """Run ``spec``'s script on its processes and return when every one has finished successfully.

    ``environ`` is the environment the workers inherit (default: this process's).

    Raises:
        LaunchError: before starting, when the script or port is unusable; afterwards, when a worker
            failed (the message names its rank; ``exit_code`` is the worker's) or the launcher was
            signalled. Every worker has been stopped by then. With ``spec.tolerate_worker_failures``
            a failed non-chief worker is not an error: it is logged (WARNING) and the job goes on.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError as TorchRendezvousError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    from towers.launch.nodes import joined_nodes, rendezvous_timeouts
    from towers.launch.output import WholeLineLogs
    from towers.launch.parent_death import continue_stopped_children, guarded_command

    spec = resolve_ports(spec)
    preflight(spec)
    environ = read_environ() if environ is None else environ
    try:
        join_timeout_s = spec.join_timeout_s or read_join_timeout(environ)
    except ClusterConfigError as exc:
        raise LaunchError(str(exc), exit_code=2) from None
    updates = spec.worker_environment(environ)
    rendezvous = spec.rdzv_endpoint or f"{spec.master_addr}:{spec.master_port}"
    log.info("launching %d process(es) per node on %s node(s), rendezvous %s (%s), strategy=%s num_ps=%s, "
             "OMP_NUM_THREADS=%s%s: %s", spec.nproc_per_node,
             spec.min_nodes if spec.is_single_node or spec.min_nodes == spec.max_nodes
             else f"{spec.min_nodes}-{spec.max_nodes}", rendezvous, spec.rdzv_backend, spec.strategy or "default",
             spec.num_ps, updates.get("OMP_NUM_THREADS", environ.get("OMP_NUM_THREADS")),
             ", a failed non-chief worker does not stop the job" if spec.tolerate_worker_failures else "",
             " ".join(spec.command()))
    supervised = spec.tolerate_worker_failures or spec.restarts_lost_replica
    report_dir = tempfile.mkdtemp(prefix="towers-launch-") if supervised else None
    # Where a strategy notes that it was built: a job started with --strategy that never builds one is told so.
    notes_dir = tempfile.mkdtemp(prefix="towers-launch-notes-") if spec.strategy is not None else None
    if notes_dir is not None:
        updates[LAUNCH_DIR_VARIABLE] = notes_dir
    strategy_unused = False
    # The agent's workers inherit this process's environment, so the additions go there for the call.
    with environ_overrides({**environ, **updates}), contextlib.ExitStack() as stack:
        if notes_dir is not None:
            stack.callback(shutil.rmtree, notes_dir, ignore_errors=True)
        try:
            stack.enter_context(joined_nodes(spec, join_timeout_s=join_timeout_s,
                                             report=visible_warning(log, prefix="towers launch:")))
        except RendezvousError as exc:
            raise LaunchError(f"node {spec.node_rank}: {exc}") from None
        except ValueError as exc:
            raise LaunchError(str(exc), exit_code=2) from None
        if spec.restarts_lost_replica:
            address = stack.enter_context(job_lighthouse(spec, environ))
            if address is not None:
                stack.enter_context(environ_overrides({"TORCHFT_LIGHTHOUSE": address}))  # the workers inherit it
        try:
            config, cmd, cmd_args = config_from_args(_torchrun_namespace(spec))
            config.rdzv_configs.update(rendezvous_timeouts(spec, join_timeout_s))
            if spec.restarts_lost_replica:  # one supervisor per replica group starts (and restarts) its processes
                from towers.launch.replica_group import group_command

                cmd, cmd_args = group_command(cmd, cmd_args, group_size=spec.group_size,
                                              restarts=spec.group_restarts or 0, report_dir=report_dir,
                                              stopped_kill_s=max(2.0, 5 * _peer_timeout_s(spec)))
            elif report_dir is not None:  # the supervisor wraps the command; torchrun's variables reach it unchanged
                from towers.launch.supervise import supervised_command

                cmd, cmd_args = supervised_command(cmd, cmd_args, report_dir=report_dir)
            cmd, cmd_args = guarded_command(cmd, cmd_args)  # workers die with this process, however it dies
            log_dir = spec.torchrun_options.get("log_dir")
            if log_dir != os.devnull:  # whole, rank-prefixed lines on the terminal (towers.launch.output)
                config.logs_specs = stack.enter_context(contextlib.closing(
                    WholeLineLogs.from_torchrun(config.logs_specs, log_dir=log_dir)))
            with continue_stopped_children():  # a stopped worker acts on the agent's SIGTERM at once
                elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
        except ChildFailedError as exc:
            error = _failure_error(exc, spec)
            _announce_first_failure(exc, spec)
            tolerated = _tolerated_text(report_dir)
            if tolerated:
                error = LaunchError(f"{error}\nBefore that, {'; '.join(tolerated)}, and the job went on without "
                                    f"{'it' if len(tolerated) == 1 else 'them'} (--tolerate-worker-failures).",
                                    exit_code=error.exit_code, failed_rank=error.failed_rank)
            raise error from None
        except SignalException as exc:
            sig = signal.Signals(exc.sigval)
            raise LaunchError(f"towers launch received {sig.name} and stopped every worker.",
                              exit_code=128 + int(sig)) from None
        except (TorchRendezvousError, RuntimeError, ValueError) as exc:
            raise _start_error(exc, rendezvous, spec, join_timeout_s) from None
        finally:
            tolerated = _tolerated_text(report_dir)
            restarted = _restarted_text(report_dir)
            strategy_unused = notes_dir is not None and not strategies_built(notes_dir)
            if report_dir is not None:
                shutil.rmtree(report_dir, ignore_errors=True)
    for line in restarted:
        log.warning("%s, and the others trained on", line)
    for line in tolerated:
        log.warning("%s during the job; the parameter-server job finished without it "
                    "(--tolerate-worker-failures; --no-tolerate-worker-failures stops the job instead)", line)
    if strategy_unused:
        log.warning("--strategy %s was not used: no process%s built a towers strategy, so the script ran as it would "
                    "under plain torchrun. Call towers.strategy_from_env() in the script: it returns the strategy "
                    "--strategy names (and --strategy-option configures).", spec.strategy,
                    "" if spec.is_single_node else " on this node")
