"""``DeploySpec``: one multi-machine training job, validated once, rendered by ``kubernetes``/``slurm``."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from towers.cluster.roles import strategy_entry
from towers.errors import InvalidArgumentError
from towers.launch.spec import LaunchSpec

__all__ = ["DeploySpec", "KINDS", "ACCESS_MODES", "check_dns1123_label", "check_dns1123_subdomain", "MAX_NAME_LENGTH"]

#: What ``towers k8s --kind`` renders.
KINDS = ("pytorchjob", "trainjob", "indexed-job", "slurm")
#: Access modes of the rendered checkpoint claim (``--checkpoint-access-mode``).
ACCESS_MODES = ("ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod")
#: Job names stay short enough for the pod names Kubernetes derives (``<name>-worker-12``) to fit 63 characters.
MAX_NAME_LENGTH = 45

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds, or no limit.
_SLURM_TIME = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|unlimited|INFINITE|infinite)$")
_PARTITION = re.compile(r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*$")


def check_dns1123_label(value: str, what: str, *, max_length: int = 63) -> str:
    """Return ``value`` when it is a DNS-1123 label (Kubernetes object name) of at most ``max_length`` chars.

    Raises:
        ValueError: naming ``what``, the rule, the value received and a valid example.
    """
    if not isinstance(value, str) or not _LABEL.match(value) or len(value) > max_length:
        suggestion = re.sub(r"[^a-z0-9-]+", "-", str(value).lower()).strip("-")[:max_length].strip("-") or "my-job"
        raise InvalidArgumentError(
            f"{what} must be a DNS-1123 label: lower-case letters, digits and '-', starting and ending with a "
            f"letter or digit, at most {max_length} characters. Received: {value!r}. Example: {suggestion!r}.")
    return value


def check_dns1123_subdomain(value: str, what: str) -> str:
    """Return ``value`` when it is a DNS-1123 subdomain (dot-separated labels, at most 253 characters).

    Raises:
        ValueError: naming ``what``, the value received and the rule.
    """
    if not isinstance(value, str) or len(value) > 253 or not all(_LABEL.match(p) for p in value.split(".")):
        raise InvalidArgumentError(f"{what} must be a DNS-1123 subdomain (lower-case letters, digits, '-' and '.'). "
                                   f"Received: {value!r}. Example: 'train-checkpoints'.")
    return value


def _check_quantity(value: str | None, what: str) -> None:
    if value is not None and not _QUANTITY.match(str(value)):
        raise InvalidArgumentError(f"{what} must be a Kubernetes quantity such as '8', '500m' or '32Gi'. Received: {value!r}.")


@dataclass(frozen=True, kw_only=True)
class DeploySpec:
    """A training job on ``nnodes`` machines, each running ``towers launch`` with ``nproc_per_node`` processes.

    ``nproc_per_node`` is passed to ``towers launch`` as is (a number, or ``auto``/``gpu``/``cpu``).
    ``checkpoint_pvc=None`` renders a new claim ``<name>-ckpt`` of ``checkpoint_size``; a name uses
    an existing claim. Every process gets ``TOWERS_CHECKPOINT_DIR`` = the mount path, so a restarted
    job resumes from the last checkpoint there. The claim's access mode (``checkpoint_access_mode``)
    defaults to ``ReadWriteOnce`` on one node — what the default storage class of GKE, EKS, AKS,
    kind, minikube and k3s provides, so it binds — and to ``ReadWriteMany`` on several nodes, since
    every pod reads the checkpoint: that needs a shared-file storage class (NFS, CephFS, EFS,
    Filestore, Azure Files), named with ``checkpoint_storage_class``. ``runtime``: the Kubeflow
    Trainer v2 runtime a ``TrainJob`` uses.
    """

    name: str
    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    image: str | None = None
    nnodes: int = 1
    nproc_per_node: str = "1"
    gpus_per_node: int = 0
    cpus_per_node: str | None = None
    memory_per_node: str | None = None
    namespace: str = "default"
    strategy: str | None = None
    num_ps: int | None = None
    strategy_options: Mapping[str, Any] = field(default_factory=dict)
    max_restarts: int = 3
    backoff_limit: int = 6
    grace_period_s: int = 60
    port: int | None = None
    checkpoint_pvc: str | None = None
    checkpoint_size: str = "10Gi"
    checkpoint_dir: str | None = None
    checkpoint_access_mode: str | None = None
    checkpoint_storage_class: str | None = None
    runtime: str = "torch-distributed"
    env: Mapping[str, str] = field(default_factory=dict)
    partition: str | None = None
    time_limit: str | None = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)
        check_dns1123_label(self.name, "--name", max_length=MAX_NAME_LENGTH)
        check_dns1123_label(self.namespace, "--namespace")
        set_("script_args", tuple(str(a) for a in self.script_args))
        set_("nproc_per_node", str(self.nproc_per_node).strip().lower())
        set_("env", MappingProxyType({str(k): str(v) for k, v in dict(self.env).items()}))
        if self.image is not None and (not self.image.strip() or any(c.isspace() for c in self.image)):
            raise InvalidArgumentError(f"--image must be a container image reference without spaces. Received: {self.image!r}. "
                                       "Example: ghcr.io/me/train:1.0.")
        for what, value, low in (("--nnodes", self.nnodes, 1), ("--gpus-per-node", self.gpus_per_node, 0),
                                 ("--max-restarts", self.max_restarts, 0), ("--backoff-limit", self.backoff_limit, 0),
                                 ("--grace-period", self.grace_period_s, 10)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(f"{what} must be an integer >= {low}. Received: {value!r}.")
        if self.nproc_per_node.isdigit():
            nproc = int(self.nproc_per_node)
            if self.gpus_per_node and nproc > self.gpus_per_node:
                raise InvalidArgumentError(
                    f"--nproc-per-node {nproc} is more than --gpus-per-node {self.gpus_per_node}: each replica owns "
                    "one GPU. Use --nproc-per-node gpu, or request more GPUs.")
        elif self.nproc_per_node not in ("auto", "gpu", "cpu"):
            raise InvalidArgumentError(f"--nproc-per-node must be a positive integer, 'auto', 'gpu' or 'cpu'. "
                                       f"Received: {self.nproc_per_node!r}.")
        if self.nproc_per_node == "gpu" and not self.gpus_per_node:
            raise InvalidArgumentError("--nproc-per-node gpu needs --gpus-per-node > 0, else the pods get no GPU. "
                                       "Set --gpus-per-node, or use a number of processes.")
        # The launch flags must pass the same checks `towers launch` will apply on every node.
        # (auto/gpu/cpu are resolved on the node; assume enough processes for the parameter servers.)
        nproc = int(self.nproc_per_node) if self.nproc_per_node.isdigit() else (self.num_ps or 0) + 1
        launch = LaunchSpec(script=self.script, script_args=self.script_args, module=self.module, nproc_per_node=nproc,
                            min_nodes=self.nnodes, max_nodes=self.nnodes, strategy=self.strategy, num_ps=self.num_ps,
                            max_restarts=self.max_restarts, strategy_options=self.strategy_options)
        set_("strategy", launch.strategy)
        set_("num_ps", launch.num_ps)
        if self.port is not None and not 1024 <= self.port < 65536:
            raise InvalidArgumentError(f"--port must be in 1024..65535. Received: {self.port}.")
        _check_quantity(self.cpus_per_node, "--cpus-per-node")
        _check_quantity(self.memory_per_node, "--memory-per-node")
        _check_quantity(self.checkpoint_size, "--checkpoint-size")
        if self.checkpoint_pvc is not None:
            check_dns1123_subdomain(self.checkpoint_pvc, "--checkpoint-pvc")
        if self.checkpoint_access_mode is None:
            set_("checkpoint_access_mode", "ReadWriteOnce" if self.nnodes == 1 else "ReadWriteMany")
        elif self.checkpoint_access_mode not in ACCESS_MODES:
            raise InvalidArgumentError(f"--checkpoint-access-mode must be one of {', '.join(ACCESS_MODES)}. "
                                       f"Received: {self.checkpoint_access_mode!r}.")
        if self.nnodes > 1 and self.checkpoint_access_mode != "ReadWriteMany" and self.checkpoint_pvc is None:
            raise InvalidArgumentError(
                f"--checkpoint-access-mode {self.checkpoint_access_mode} cannot serve {self.nnodes} nodes: every pod "
                "reads the checkpoint, so pods on different nodes need ReadWriteMany (a shared-file storage class "
                "such as NFS, CephFS, EFS, Filestore or Azure Files: --checkpoint-storage-class NAME). Use "
                "--checkpoint-access-mode ReadWriteMany, or --checkpoint-pvc with an existing shared claim.")
        if self.checkpoint_storage_class is not None:
            check_dns1123_subdomain(self.checkpoint_storage_class, "--checkpoint-storage-class")
        check_dns1123_subdomain(self.runtime, "--runtime")
        if self.checkpoint_dir is not None and (not self.checkpoint_dir.startswith("/")
                                                or any(c in self.checkpoint_dir for c in "\"'`\\ ")):
            raise InvalidArgumentError(f"--checkpoint-dir must be an absolute path without spaces or quotes. "
                                       f"Received: {self.checkpoint_dir!r}. Example: /checkpoints.")
        if self.time_limit is not None and not _SLURM_TIME.match(str(self.time_limit)):
            raise InvalidArgumentError(f"--time must be a SLURM time limit: MINUTES, HH:MM:SS, DAYS-HH, DAYS-HH:MM:SS or "
                                       f"UNLIMITED. Received: {self.time_limit!r}. Example: --time 24:00:00.")
        if self.partition is not None and not _PARTITION.match(str(self.partition)):
            raise InvalidArgumentError(f"--partition must be a SLURM partition name (letters, digits, '_', '.', '-'; several "
                                       f"separated by ','). Received: {self.partition!r}. Example: --partition gpu.")
        if not str(self.script).strip() or any(c in str(self.script) for c in "\n\r\0"):
            raise InvalidArgumentError(f"the training script must be a path or module name on one line. Received: "
                                       f"{self.script!r}. Example: train.py.")
        if self.nproc_per_node.isdigit() and int(self.nproc_per_node) < 1:
            raise InvalidArgumentError(f"--nproc-per-node must be a positive integer, 'auto', 'gpu' or 'cpu'. "
                                       f"Received: {self.nproc_per_node!r}.")
        for key, text in self.env.items():
            if "\0" in text:
                raise InvalidArgumentError(f"--env {key}: a value cannot contain a NUL character. Received: {text!r}.")
        for key in self.env:
            if not _ENV_NAME.match(key):
                raise InvalidArgumentError(f"--env names must be shell variable names (letters, digits, '_'). Received: {key!r}.")

    @property
    def claim_name(self) -> str:
        """The PersistentVolumeClaim that holds checkpoints."""
        return self.checkpoint_pvc or f"{self.name}-ckpt"

    def launch_args(self) -> list[str]:
        """Return the ``towers launch`` arguments after the rendezvous flags: restarts, strategy, script."""
        args = ["--max-restarts", str(self.max_restarts)]
        if self.strategy is not None:
            args += ["--strategy", self.strategy]
            if strategy_entry(self.strategy).has_ps:  # ps and hybrid (and their aliases): the job's ps tasks
                args += ["--num-ps", str(self.num_ps)]
            for key, value in self.strategy_options.items():  # every option reaches every node's launcher
                args += ["--strategy-option", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
        if self.module:
            args.append("-m")
        return [*args, self.script, *self.script_args]

    def launch_command(self, *, nnodes: str, rdzv_endpoint: str, rdzv_id: str) -> str:
        """Return the ``towers launch`` shell command; the three arguments are shell words, inserted unquoted."""
        head = f"towers launch --nnodes {nnodes} --nproc-per-node {shlex.quote(self.nproc_per_node)}"
        rdzv = f"--rdzv-backend c10d --rdzv-endpoint {rdzv_endpoint} --rdzv-id {rdzv_id}"
        return f"{head} {rdzv} {' '.join(shlex.quote(a) for a in self.launch_args())}"
