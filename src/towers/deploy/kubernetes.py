"""Kubernetes manifests for a multi-machine job: a Kubeflow ``PyTorchJob``, or a plain Indexed ``Job``.

Each pod runs ``towers launch`` with ``nproc_per_node`` processes and a c10d rendezvous, so the
job survives worker restarts (``--max-restarts``) and a restarted pod (``restartPolicy: OnFailure``)
rejoins; checkpoints live on a PersistentVolumeClaim mounted in every pod, so the script resumes
from the last one. ``/dev/shm`` is a memory volume (the container default of 64 MB breaks
DataLoader workers and NCCL).

- ``pytorchjob`` needs the Kubeflow training operator. It creates a ``Master`` pod and
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

__all__ = ["render_pytorchjob", "render_indexed_job", "render_kubernetes", "KUBEFLOW_PORT", "RDZV_PORT",
           "CHECKPOINT_MOUNT"]

#: Port the Kubeflow operator publishes as MASTER_PORT (its container port ``pytorchjob-port``).
KUBEFLOW_PORT = 23456
#: Rendezvous port on pod 0 of an Indexed Job.
RDZV_PORT = 29500
#: Where the checkpoint claim is mounted unless ``checkpoint_dir`` says otherwise.
CHECKPOINT_MOUNT = "/checkpoints"


def _labels(spec: DeploySpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": spec.name, "app.kubernetes.io/managed-by": "towers"}


def _metadata(spec: DeploySpec, name: str | None = None) -> dict[str, Any]:
    return {"name": name or spec.name, "namespace": spec.namespace, "labels": _labels(spec)}


def _require_image(spec: DeploySpec, kind: str) -> str:
    if not spec.image:
        raise ValueError(f"--image is required for --kind {kind}: the pods need a container image with towers and "
                         "your script installed. Received: no --image. Example: --image ghcr.io/me/train:1.0.")
    return spec.image


def _pod_spec(spec: DeploySpec, command: str, port: int, *, port_name: str) -> dict[str, Any]:
    mount = spec.checkpoint_dir or CHECKPOINT_MOUNT
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
    env = [{"name": "TOWERS_CHECKPOINT_DIR", "value": mount}]
    env += [{"name": k, "value": v} for k, v in spec.env.items() if k != "TOWERS_CHECKPOINT_DIR"]
    container = {
        "name": "pytorch",  # the Kubeflow operator looks for this container name
        "image": spec.image,
        "command": ["sh", "-c", command],
        "env": env,
        "ports": [{"name": port_name, "containerPort": port}],
        "volumeMounts": [{"name": "checkpoints", "mountPath": mount}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if resources:
        container["resources"] = resources
    return {
        "containers": [container],
        "volumes": [
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.claim_name}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }


def _claim(spec: DeploySpec) -> list[dict[str, Any]]:
    if spec.checkpoint_pvc is not None:
        return []  # the user's existing claim
    return [{
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(spec, spec.claim_name),
        # Every node mounts it (only the chief writes), so it must be shareable across nodes.
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": spec.checkpoint_size}}},
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
    """Return the YAML text of ``kind`` (``pytorchjob`` or ``indexed-job``) for ``spec``.

    Raises:
        ValueError: on an unknown kind or a missing image.
    """
    renderers = {"pytorchjob": render_pytorchjob, "indexed-job": render_indexed_job}
    if kind not in renderers:
        raise ValueError(f"--kind must be one of {', '.join(renderers)} for Kubernetes. Received: {kind!r}.")
    header = (f"# {kind} {spec.name!r}: {spec.nnodes} node(s) x {spec.nproc_per_node} process(es), rendered by "
              f"`towers k8s`.\n# Apply with: kubectl apply -f <this file>\n")
    return header + to_yaml_documents(renderers[kind](spec))
