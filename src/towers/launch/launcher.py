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
import os
import shutil
import signal
import tempfile
from typing import Any, Mapping

from towers._logging import get_logger
from towers.cluster import ClusterConfigError, environ_overrides, read_environ, read_join_timeout
from towers.cluster.launch_notes import LAUNCH_DIR_VARIABLE, strategies_built
from towers.cluster.rendezvous import RendezvousError, visible_warning
from towers.launch.errors import LaunchError
from towers.launch.failures import announce_first_failure as _announce_first_failure
from towers.launch.failures import failure_error as _failure_error
from towers.launch.failures import restarted_text as _restarted_text
from towers.launch.failures import start_error as _start_error
from towers.launch.failures import tolerated_text as _tolerated_text
from towers.launch.job_lighthouse import DEFAULT_LIGHTHOUSE_PORT, job_lighthouse
from towers.launch.job_lighthouse import checked_peer_timeout_s as _peer_timeout_s
from towers.launch.preflight import DEFAULT_MULTI_NODE_PORT, preflight, resolve_ports
from towers.launch.spec import LaunchSpec

__all__ = ["LaunchError", "launch", "resolve_ports", "preflight", "job_lighthouse", "DEFAULT_MULTI_NODE_PORT",
           "DEFAULT_LIGHTHOUSE_PORT"]

log = get_logger(__name__)


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
