"""``TF_CONFIG``: tf.distribute's JSON description of a cluster and of this process's task.

Rank order (the contract every strategy relies on): the chief first, then the workers in index
order, then the parameter servers in index order. So rank 0 is the chief (worker 0 when the
cluster lists no chief), and the parameter servers take the last ``num_ps`` ranks, as under
``towers launch --num-ps K``. ``world_size`` counts chief + workers + ps.

An ``evaluator`` is not part of the training group: it gets a one-process world of its own
(rank 0 of 1), ``is_chief`` is False, and it never joins the workers' process group.

The rendezvous (``master_addr``/``master_port``) is the chief's address (or worker 0's).
``local_rank`` counts the tasks listed earlier on the same host; ``node_rank`` numbers the
distinct hosts in rank order.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from towers.cluster.base import ClusterConfigError, ClusterEnvironment, launch_options
from towers.cluster.info import TASK_TYPES, ClusterSpec, ProcessInfo, TaskInfo
from towers.errors import InvalidArgumentError, user_error

__all__ = ["TFConfigEnvironment", "TRAINING_ORDER", "parse_tf_config", "split_host_port"]

#: Task types of the training group, in global rank order.
TRAINING_ORDER = ("chief", "worker", "ps")

_EXAMPLE = ('{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222"], "ps": ["host2:2222"]}, '
            '"task": {"type": "worker", "index": 0}}')


def _bad(what: str, received: Any, fix: str) -> Exception:
    shown = received if isinstance(received, str) else json.dumps(received, default=str)
    return user_error(f"TF_CONFIG {what}", shown, fix, cls=ClusterConfigError)


def split_host_port(address: str) -> tuple[str, int]:
    """Return ``(host, port)`` of ``"host:port"`` or ``"[v6]:port"``.

    Raises:
        ValueError: when the address has no host or no port in 1..65535.
    """
    if not isinstance(address, str) or ":" not in address:
        raise InvalidArgumentError(f"expected 'host:port', received {address!r}")
    if address.startswith("["):
        host, sep, port_text = address[1:].partition("]:")
        if not sep:
            raise InvalidArgumentError(f"expected '[ipv6]:port', received {address!r}")
    else:
        host, _, port_text = address.rpartition(":")
        if ":" in host:
            raise InvalidArgumentError(f"an IPv6 host must be bracketed, e.g. '[::1]:2222'; received {address!r}")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidArgumentError(f"expected 'host:port' with a port in 1..65535, received {address!r}")
    return host, int(port_text)


def parse_tf_config(raw: str) -> tuple[ClusterSpec, TaskInfo]:
    """Return the ``(ClusterSpec, TaskInfo)`` that the ``TF_CONFIG`` JSON text ``raw`` describes.

    Args:
        raw: the ``TF_CONFIG`` JSON text.

    Returns:
        The cluster's addresses by task type, and this process's task.

    Example:
        ```python
        from towers.cluster import parse_tf_config

        spec, task = parse_tf_config('{"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
                                     '"task": {"type": "worker", "index": 1}}')
        assert spec.num_workers == 2 and task.index == 1
        ```

    Raises:
        ClusterConfigError: naming TF_CONFIG, what is wrong, the value received and the fix.
    """
    try:
        config = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise _bad(f"is not valid JSON ({exc})", raw, f"Set TF_CONFIG to a JSON object such as {_EXAMPLE}.") from None
    if not isinstance(config, dict):
        raise _bad("must be a JSON object with 'cluster' and 'task'", raw, f"Example: {_EXAMPLE}.")
    if "cluster" not in config:
        raise _bad("has no 'cluster' (the address list of every task)", raw,
                   f"Add it, e.g. {_EXAMPLE}.")
    if "task" not in config:
        raise _bad("has no 'task' (which task this process is)", raw,
                   'Add "task": {"type": "worker", "index": N} for this process.')
    cluster, task = config["cluster"], config["task"]
    if not isinstance(cluster, dict) or not cluster:
        raise _bad("'cluster' must be a non-empty object mapping task types to address lists", cluster,
                   f"Example: {_EXAMPLE}.")
    jobs: dict[str, tuple[str, ...]] = {}
    for task_type, addresses in cluster.items():
        if task_type not in TASK_TYPES:
            raise _bad(f"lists an unknown task type {task_type!r} in 'cluster' (expected one of {TASK_TYPES})",
                       cluster, "Rename or remove that job.")
        if isinstance(addresses, str) or not isinstance(addresses, list):
            raise _bad(f"'cluster.{task_type}' must be a list of 'host:port' strings", addresses,
                       f'Write it as a list, e.g. "{task_type}": ["host:2222"].')
        for address in addresses:
            try:
                split_host_port(address)
            except ValueError as exc:
                raise _bad(f"has an address in 'cluster.{task_type}' that is not host:port ({exc})", addresses,
                           "Write each address as 'host:port' (IPv6: '[addr]:port').") from None
        if addresses:
            jobs[task_type] = tuple(addresses)
    if len(jobs.get("chief", ())) > 1:
        raise _bad("lists more than one chief", cluster["chief"], "Keep one chief and list the others as workers.")
    if not jobs.get("chief") and not jobs.get("worker"):
        raise _bad("has no 'chief' or 'worker' task, so nothing would train", cluster,
                   "List at least one worker (worker 0 becomes the chief).")
    if not isinstance(task, dict):
        raise _bad("'task' must be an object with 'type' and 'index'", task, 'Example: "task": {"type": "worker", "index": 0}.')
    task_type, index = task.get("type"), task.get("index")
    if task_type not in TASK_TYPES:
        raise _bad(f"'task.type' must be one of {TASK_TYPES}", task, "Fix the task type of this process.")
    if task_type not in jobs:
        raise _bad(f"'task.type' is {task_type!r} but 'cluster' lists no {task_type!r} tasks", config,
                   f"Add this process's address to 'cluster.{task_type}' or fix 'task.type'.")
    if isinstance(index, bool) or not isinstance(index, int):
        raise _bad("'task.index' must be an integer", task, 'Example: "task": {"type": "worker", "index": 0}.')
    if not 0 <= index < len(jobs[task_type]):
        raise _bad(f"'task.index' {index} is out of range: 'cluster.{task_type}' has {len(jobs[task_type])} "
                   f"address(es), so valid indices are 0..{len(jobs[task_type]) - 1}", task,
                   f"Fix the index or add the missing address to 'cluster.{task_type}'.")
    return ClusterSpec(jobs), TaskInfo(type=task_type, index=index)


class TFConfigEnvironment(ClusterEnvironment):
    """Reads ``TF_CONFIG`` (see the module docstring for the rank order)."""

    name = "tf_config"

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Return True when ``TF_CONFIG`` is set and not empty."""
        return bool(environ.get("TF_CONFIG", "").strip())

    def process_info(self, environ: Mapping[str, str]) -> ProcessInfo:
        """Return this task's ``ProcessInfo``; raises ``ClusterConfigError`` on a malformed TF_CONFIG."""
        spec, task = parse_tf_config(environ.get("TF_CONFIG", ""))
        num_ps = spec.num_tasks("ps")
        # The ps count comes from the cluster itself (it fixes the ranks); TOWERS_STRATEGY may still override.
        strategy, _ = launch_options(environ, default_strategy="ps" if num_ps else "multi_worker_mirrored",
                                     default_num_ps=num_ps)
        ordered = [(t, i, a) for t in TRAINING_ORDER for i, a in enumerate(spec.addresses(t))]
        chief_host, chief_port = split_host_port(ordered[0][2])
        if task.type == "evaluator":
            return ProcessInfo(rank=0, world_size=1, master_addr=chief_host, master_port=chief_port, task=task,
                               cluster=spec, source=self.name, strategy=strategy, num_ps=num_ps, chief_rank=0)
        rank = next(r for r, (t, i, _) in enumerate(ordered) if (t, i) == (task.type, task.index))
        hosts = [split_host_port(a)[0] for _, _, a in ordered]
        my_host = hosts[rank]
        distinct_hosts = list(dict.fromkeys(hosts))
        return ProcessInfo(
            rank=rank,
            world_size=len(ordered),
            local_rank=hosts[:rank].count(my_host),
            local_world_size=hosts.count(my_host),
            node_rank=distinct_hosts.index(my_host),
            master_addr=chief_host,
            master_port=chief_port,
            task=task,
            cluster=spec,
            source=self.name,
            strategy=strategy,
            num_ps=num_ps,
            chief_rank=0,
        )
