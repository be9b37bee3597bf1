"""Kubernetes manifests for a multi-machine job: Kubeflow ``TrainJob`` or ``PyTorchJob``, or a plain Indexed ``Job``.

Each pod runs ``towers launch`` with ``nproc_per_node`` processes and a c10d rendezvous, so the
job survives worker restarts (``--max-restarts``) and a restarted pod (``restartPolicy: OnFailure``)
rejoins; checkpoints live on a PersistentVolumeClaim mounted in every pod, so the script resumes
from the last one. ``/dev/shm`` is a memory volume (the container default of 64 MB breaks
DataLoader workers and NCCL).

- ``trainjob`` needs Kubeflow Trainer v2 (``trainer.kubeflow.org/v1alpha1``) and its
  ``torch-distributed`` runtime (``runtime``). The runtime sets ``PET_NNODES``,
  ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` in each node's pod; the rendezvous runs on node 0.
  The checkpoint volume reaches the runtime's ``node`` container through ``podTemplateOverrides``.
- ``pytorchjob`` needs the Kubeflow training operator v1 (legacy). It creates a ``Master`` pod and
  ``nnodes - 1`` ``Worker`` pods and sets ``MASTER_ADDR``/``MASTER_PORT`` in each; the rendezvous
  runs on the master.
- ``indexed-job`` needs nothing but Kubernetes >= 1.24: a headless Service gives pod ``i`` the
  name ``<name>-i.<name>``, and the rendezvous runs on pod 0.
"""

from __future__ import annotations

import shlex
from typing import Any

from towers.deploy.spec import DeploySpec
from towers.deploy.yaml import to_yaml_documents
from towers.errors import InvalidArgumentError

__all__ = ["render_trainjob", "render_pytorchjob", "render_indexed_job", "render_kubernetes", "KUBEFLOW_PORT",
           "RDZV_PORT", "CHECKPOINT_MOUNT", "TRAINER_API"]

#: Port the Kubeflow operator publishes as MASTER_PORT (its container port ``pytorchjob-port``).
KUBEFLOW_PORT = 23456
#: Rendezvous port on pod 0 of an Indexed Job.
RDZV_PORT = 29500
#: Where the checkpoint claim is mounted unless ``checkpoint_dir`` says otherwise.
CHECKPOINT_MOUNT = "/checkpoints"
#: Kubeflow Trainer v2's API group and version.
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
#: The container (and replicated job) of a Trainer v2 runtime that runs the training script.
TRAINER_NODE = "node"


def _labels(spec: DeploySpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": spec.name, "app.kubernetes.io/managed-by": "towers"}


def _metadata(spec: DeploySpec, name: str | None = None) -> dict[str, Any]:
    return {"name": name or spec.name, "namespace": spec.namespace, "labels": _labels(spec)}


def _require_image(spec: DeploySpec, kind: str) -> str:
    if not spec.image:
        raise InvalidArgumentError(f"--image is required for --kind {kind}: the pods need a container image with towers and "
                                   "your script installed. Received: no --image. Example: --image ghcr.io/me/train:1.0.")
    return spec.image


def _resources(spec: DeploySpec) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    if spec.gpus_per_node:
        limits["nvidia.com/gpu"] = spec.gpus_per_node
    if spec.cpus_per_node:
        limits["cpu"] = requests["cpu"] = spec.cpus_per_node
    if spec.memory_per_node:
        limits["memory"] = requests["memory"] = spec.memory_per_node
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _env(spec: DeploySpec) -> list[dict[str, str]]:
    env = [{"name": "TOWERS_CHECKPOINT_DIR", "value": spec.checkpoint_dir or CHECKPOINT_MOUNT}]
    return env + [{"name": k, "value": v} for k, v in spec.env.items() if k != "TOWERS_CHECKPOINT_DIR"]


def _volume_mounts(spec: DeploySpec) -> list[dict[str, str]]:
    return [{"name": "checkpoints", "mountPath": spec.checkpoint_dir or CHECKPOINT_MOUNT},
            {"name": "dshm", "mountPath": "/dev/shm"}]


def _volumes(spec: DeploySpec) -> list[dict[str, Any]]:
    return [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.claim_name}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}}]


def _pod_spec(spec: DeploySpec, command: str, port: int, *, port_name: str) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "pytorch",  # the Kubeflow operator looks for this container name
        "image": spec.image,
        "command": ["sh", "-c", command],
        "env": _env(spec),
        "ports": [{"name": port_name, "containerPort": port}],
        "volumeMounts": _volume_mounts(spec),
    }
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    # SIGTERM reaches `towers launch` first; every rank then saves at the next step it agrees on and exits
    # with code 75, which restartPolicy OnFailure restarts. The save must fit in the grace period.
    return {"containers": [container], "volumes": _volumes(spec), "terminationGracePeriodSeconds": spec.grace_period_s}


def _claim(spec: DeploySpec) -> list[dict[str, Any]]:
    if spec.checkpoint_pvc is not None:
        return []  # the user's existing claim
    return [{
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(spec, spec.claim_name),
        # Every pod mounts it (only the chief writes, every replica reads): on several nodes it must
        # be shareable across nodes (ReadWriteMany); one node's pods can share ReadWriteOnce.
        "spec": {"accessModes": [spec.checkpoint_access_mode],
                 **({"storageClassName": spec.checkpoint_storage_class} if spec.checkpoint_storage_class else {}),
                 "resources": {"requests": {"storage": spec.checkpoint_size}}},
    }]


def render_pytorchjob(spec: DeploySpec) -> list[dict[str, Any]]:
    """Return the manifests (checkpoint claim, Kubeflow ``PyTorchJob``) as plain dicts."""
    _require_image(spec, "pytorchjob")
    port = spec.port or KUBEFLOW_PORT
    command = "exec " + spec.launch_command(nnodes=str(spec.nnodes), rdzv_endpoint='"${MASTER_ADDR}:${MASTER_PORT}"',
                                            rdzv_id=shlex.quote(spec.name))

    def replica(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"metadata": {"labels": _labels(spec)},
                             "spec": _pod_spec(spec, command, port, port_name="pytorchjob-port")}}

    replicas = {"Master": replica(1)}
    if spec.nnodes > 1:
        replicas["Worker"] = replica(spec.nnodes - 1)
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(spec),
        "spec": {"runPolicy": {"backoffLimit": spec.backoff_limit, "cleanPodPolicy": "Running"},
                 "pytorchReplicaSpecs": replicas},
    }
    return [*_claim(spec), job]


def render_trainjob(spec: DeploySpec) -> list[dict[str, Any]]:
    """Return the manifests (checkpoint claim, Kubeflow Trainer v2 ``TrainJob``) as plain dicts."""
    image = _require_image(spec, "trainjob")
    if spec.port is not None:
        raise InvalidArgumentError(f"--port does not apply to --kind trainjob: the Kubeflow Trainer runtime picks the rendezvous "
                                   f"port (PET_MASTER_PORT). Received: --port {spec.port}. Drop --port.")
    command = "exec " + spec.launch_command(nnodes='"${PET_NNODES}"',
                                            rdzv_endpoint='"${PET_MASTER_ADDR}:${PET_MASTER_PORT}"',
                                            rdzv_id=shlex.quote(spec.name))
    nproc: int | str = int(spec.nproc_per_node) if spec.nproc_per_node.isdigit() else spec.nproc_per_node
    trainer: dict[str, Any] = {"image": image, "command": ["sh", "-c", command], "env": _env(spec),
                               "numNodes": spec.nnodes, "numProcPerNode": nproc}
    resources = _resources(spec)
    if resources:
        trainer["resourcesPerNode"] = resources
    job = {
        "apiVersion": TRAINER_API,
        "kind": "TrainJob",
        "metadata": _metadata(spec),
        "spec": {
            "runtimeRef": {"name": spec.runtime},
            "trainer": trainer,
            "labels": _labels(spec),
            "podTemplateOverrides": [{
                "targetJobs": [{"name": TRAINER_NODE}],
                "spec": {"volumes": _volumes(spec),
                         "containers": [{"name": TRAINER_NODE, "volumeMounts": _volume_mounts(spec)}]},
            }],
        },
    }
    return [*_claim(spec), job]


def render_indexed_job(spec: DeploySpec) -> list[dict[str, Any]]:
    """Return the manifests (checkpoint claim, headless Service, Indexed ``Job``) as plain dicts."""
    _require_image(spec, "indexed-job")
    port = spec.port or RDZV_PORT
    endpoint = f"{spec.name}-0.{spec.name}:{port}"
    command = "exec " + spec.launch_command(nnodes=str(spec.nnodes), rdzv_endpoint=endpoint,
                                            rdzv_id=shlex.quote(spec.name))
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec),
        # Headless, and resolvable before the pods are ready: the rendezvous needs the names first.
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"job-name": spec.name},
                 "ports": [{"name": "rendezvous", "port": port, "targetPort": port}]},
    }
    pod = _pod_spec(spec, command, port, port_name="rendezvous")
    pod.update({"subdomain": spec.name, "restartPolicy": "OnFailure"})
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(spec),
        "spec": {"completionMode": "Indexed", "completions": spec.nnodes, "parallelism": spec.nnodes,
                 "backoffLimit": spec.backoff_limit,
                 "template": {"metadata": {"labels": _labels(spec)}, "spec": pod}},
    }
    return [*_claim(spec), service, job]


def render_kubernetes(spec: DeploySpec, kind: str = "pytorchjob") -> str:
    """Return the YAML text of ``kind`` (``trainjob``, ``pytorchjob`` or ``indexed-job``) for ``spec``.

    Raises:
        ValueError: on an unknown kind or a missing image.
    """
    renderers = {"trainjob": render_trainjob, "pytorchjob": render_pytorchjob, "indexed-job": render_indexed_job}
    if kind not in renderers:
        raise InvalidArgumentError(f"--kind must be one of {', '.join(renderers)} for Kubernetes. Received: {kind!r}.")
    header = (f"# {kind} {spec.name!r}: {spec.nnodes} node(s) x {spec.nproc_per_node} process(es), rendered by "
              f"`towers k8s`.\n# Apply with: kubectl apply -f <this file>\n")
    if spec.checkpoint_pvc is None:
        storage = (f"storage class {spec.checkpoint_storage_class!r}" if spec.checkpoint_storage_class
                   else "default storage class")
        header += (f"# Checkpoints: a new {spec.checkpoint_access_mode} claim {spec.claim_name!r} on the {storage}"
                   + (" (several nodes share it: the class must offer ReadWriteMany, e.g. NFS, CephFS, EFS, Filestore, "
                      "Azure Files)" if spec.checkpoint_access_mode == "ReadWriteMany" else "") + ".\n")
    return header + to_yaml_documents(renderers[kind](spec))
