"""Run a towers job on many machines: Kubernetes manifests (Kubeflow TrainJob/PyTorchJob, Indexed Job), SLURM scripts."""

from __future__ import annotations

from towers.deploy.kubernetes import render_indexed_job, render_kubernetes, render_pytorchjob, render_trainjob
from towers.deploy.slurm import render_sbatch
from towers.deploy.spec import ACCESS_MODES, KINDS, DeploySpec, check_dns1123_label, check_dns1123_subdomain
from towers.deploy.yaml import to_yaml, to_yaml_documents
from towers.errors import InvalidArgumentError

__all__ = [
    "DeploySpec",
    "KINDS",
    "ACCESS_MODES",
    "render",
    "render_trainjob",
    "render_pytorchjob",
    "render_indexed_job",
    "render_kubernetes",
    "render_sbatch",
    "to_yaml",
    "to_yaml_documents",
    "check_dns1123_label",
    "check_dns1123_subdomain",
]


def render(spec: DeploySpec, kind: str = "pytorchjob") -> str:
    """Return the text for ``kind``: YAML for ``trainjob``/``pytorchjob``/``indexed-job``, a shell script for ``slurm``.

    Raises:
        ValueError: on an unknown kind, or a spec the kind cannot express (e.g. no image for Kubernetes).
    """
    if kind == "slurm":
        return render_sbatch(spec)
    if kind not in KINDS:
        raise InvalidArgumentError(f"--kind must be one of {', '.join(KINDS)}. Received: {kind!r}.")
    return render_kubernetes(spec, kind)
