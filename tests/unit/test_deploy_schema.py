"""Rendered manifests checked against the Kubernetes schemas (kubernetes-validate, strict), read back from
the YAML text a user applies; TrainJob's own fields checked against Kubeflow Trainer v2's API; the custom resources
(TrainJob, PyTorchJob, and the JobSet a TrainJob becomes under its runtime) against their CRD schemas kept in
tests/data/crds; the sbatch script run by bash under `set -euo pipefail` with stand-ins for scontrol and srun."""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
from pathlib import Path

import jsonschema  # kubernetes-validate's own dependency
import kubernetes_validate
import pytest
import yaml

from towers.deploy import DeploySpec, render

K8S_VERSION = kubernetes_validate.latest_version()
CRDS = Path(__file__).resolve().parent.parent / "data" / "crds"

# Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1) TrainJob fields, from its API types: a CRD is
# not in the Kubernetes schemas, so its own fields are checked here and its pod parts as core objects.
TRAINJOB_FIELDS = {
    "spec": {"runtimeRef", "initializer", "trainer", "labels", "annotations", "podTemplateOverrides", "suspend",
             "managedBy"},
    "runtimeRef": {"name", "apiGroup", "kind"},
    "trainer": {"image", "command", "args", "env", "numNodes", "resourcesPerNode", "numProcPerNode"},
    "override": {"targetJobs", "metadata", "spec"},
    "override.spec": {"serviceAccountName", "nodeSelector", "affinity", "tolerations", "volumes", "initContainers",
                      "containers", "schedulingGates", "imagePullSecrets"},
    "override.container": {"name", "env", "volumeMounts"},
}


def spec(**kwargs) -> DeploySpec:
    # Values a hand-written YAML writer would turn into numbers: ".5", ".inf", "1e3", "yes".
    base = {"name": "digits", "image": "ghcr.io/me/train:1.0", "nnodes": 2, "nproc_per_node": "4",
            "gpus_per_node": 4, "cpus_per_node": "0.5", "memory_per_node": "64Gi", "script": "train.py",
            "script_args": ("--lr", ".5"), "env": {"LR": ".5", "LIMIT": ".inf", "STEPS": "1e3", "FLAG": "yes"}}
    return DeploySpec(**{**base, **kwargs})


def validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def validate_pod_template(template: dict) -> None:
    validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})


def validate_crd(doc: dict, schema: str) -> None:
    """Check ``doc`` against the CRD schema ``tests/data/crds/<schema>.json`` (raises ``jsonschema.ValidationError``)."""
    jsonschema.Draft202012Validator(json.loads((CRDS / f"{schema}.json").read_text())).validate(doc)


def documents(kind: str, **kwargs) -> list[dict]:
    return list(yaml.safe_load_all(render(spec(**kwargs), kind)))


def test_strings_stay_strings_and_a_bad_value_is_caught():
    (claim, _service, job) = documents("indexed-job")
    for doc in (claim, _service, job):
        validate(doc)
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LR"] == ".5" and env["LIMIT"] == ".inf" and env["STEPS"] == "1e3" and env["FLAG"] == "yes"
    broken = copy.deepcopy(job)
    broken["spec"]["template"]["spec"]["containers"][0]["env"][1]["value"] = 0.5  # what `.5` unquoted reads as
    with pytest.raises(kubernetes_validate.ValidationError, match="0.5 is not of type 'string'"):
        validate(broken)


def test_pytorchjob_pod_templates_and_claim_are_valid():
    claim, job = documents("pytorchjob")
    validate(claim)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # 2 nodes read it
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        validate_pod_template(replica["template"])


def test_trainjob_fields_and_its_pod_parts_are_valid():
    claim, job = documents("trainjob", checkpoint_storage_class="nfs-client")
    validate(claim)
    assert claim["spec"]["storageClassName"] == "nfs-client"
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    body = job["spec"]
    assert set(body) <= TRAINJOB_FIELDS["spec"] and set(body["runtimeRef"]) <= TRAINJOB_FIELDS["runtimeRef"]
    assert body["runtimeRef"] == {"name": "torch-distributed"}
    trainer = body["trainer"]
    assert set(trainer) <= TRAINJOB_FIELDS["trainer"]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 4
    assert '--rdzv-endpoint "${PET_MASTER_ADDR}:${PET_MASTER_PORT}"' in trainer["command"][2]
    (override,) = body["podTemplateOverrides"]
    assert set(override) <= TRAINJOB_FIELDS["override"] and override["targetJobs"] == [{"name": "node"}]
    assert set(override["spec"]) <= TRAINJOB_FIELDS["override.spec"]
    (mounts,) = override["spec"]["containers"]
    assert set(mounts) <= TRAINJOB_FIELDS["override.container"] and mounts["name"] == "node"
    # The pod the runtime's "node" container becomes, with our parts in it, is a valid Pod.
    container = {"name": "node", "image": trainer["image"], "command": trainer["command"], "env": trainer["env"],
                 "resources": trainer["resourcesPerNode"], "volumeMounts": mounts["volumeMounts"]}
    validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
              "spec": {"containers": [container], "volumes": override["spec"]["volumes"]}})
    claims = [v["persistentVolumeClaim"]["claimName"] for v in override["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [claim["metadata"]["name"]]


def test_checkpoint_access_mode_defaults_and_flag():
    (claim, _job) = documents("trainjob", nnodes=1)
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]  # binds on every default storage class
    (claim, _job) = documents("pytorchjob", nnodes=1, checkpoint_access_mode="ReadWriteOncePod")
    validate(claim)
    assert claim["spec"]["accessModes"] == ["ReadWriteOncePod"]
    with pytest.raises(ValueError, match="ReadWriteOnce cannot serve 2 nodes.*--checkpoint-storage-class"):
        spec(checkpoint_access_mode="ReadWriteOnce")
    with pytest.raises(ValueError, match="--checkpoint-access-mode must be one of"):
        spec(checkpoint_access_mode="RWX")
    assert len(documents("trainjob", checkpoint_pvc="shared", checkpoint_access_mode="ReadWriteOnce")) == 1
    with pytest.raises(ValueError, match="--port does not apply to --kind trainjob"):
        render(spec(port=29400), "trainjob")


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_sbatch_script_runs_under_pipefail_with_a_long_node_list(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # 200,000 host names: far more than a pipe holds, so `| head -n 1` would kill scontrol with SIGPIPE.
    _executable(bin_dir / "scontrol", '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] || exit 3\n'
                                      'seq -f "node%06g" 1 200000\n')
    _executable(bin_dir / "srun", f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/srun-args\n')
    script = tmp_path / "job.sbatch"
    script.write_text(render(spec(cpus_per_node="8"), "slurm"))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[000001-200000]",
           "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_SUBMIT_DIR": str(tmp_path)}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "srun-args").read_text().splitlines()
    assert "--cpus-per-task=8" in args and args.index("--cpus-per-task=8") < args.index("towers")
    assert args[args.index("--rdzv-endpoint") + 1] == f"node000001:{15000 + 4242 % 20000}"
    assert (tmp_path / "checkpoints" / "digits").is_dir()


@pytest.mark.parametrize("options", [{}, {"nnodes": 1, "gpus_per_node": 0}, {"checkpoint_pvc": "shared"}])
def test_trainjob_and_pytorchjob_match_their_crd_schemas(options):
    *_claim, trainjob = documents("trainjob", **options)
    validate_crd(trainjob, "trainjob")
    *_claim, pytorchjob = documents("pytorchjob", **options)
    validate_crd(pytorchjob, "pytorchjob")
    for path, value, error in [(("spec", "trainer", "numNodes"), "2", "'2' is not of type 'integer'"),
                               (("spec", "trainer", "numProcsPerNode"), 4, "'numProcsPerNode' was unexpected"),
                               (("spec", "runtimeRef", "kind"), "Runtime", "is not one of")]:
        broken = copy.deepcopy(trainjob)
        broken[path[0]][path[1]][path[2]] = value
        with pytest.raises(jsonschema.ValidationError, match=error):
            validate_crd(broken, "trainjob")
    broken = copy.deepcopy(pytorchjob)
    broken["spec"]["pytorchReplicaSpecs"]["Chief"] = broken["spec"]["pytorchReplicaSpecs"].pop("Master")
    with pytest.raises(jsonschema.ValidationError, match="'Chief' is not one of"):
        validate_crd(broken, "pytorchjob")


def test_a_trainjob_becomes_a_valid_jobset_of_its_runtime():
    """What Kubeflow Trainer builds from our TrainJob and the torch-distributed runtime: the trainer's fields go to the
    runtime's trainer container, the overrides to the jobs and containers they name (which must exist)."""
    _claim, job = documents("trainjob")
    runtime = yaml.safe_load((CRDS / "torch_distributed_runtime.yaml").read_text())
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    jobs = {rj["name"]: rj for rj in copy.deepcopy(runtime["spec"]["template"]["spec"]["replicatedJobs"])}
    trainer = job["spec"]["trainer"]
    for rj in jobs.values():
        if rj["template"]["metadata"]["labels"].get("trainer.kubeflow.org/trainjob-ancestor-step") == "trainer":
            rj["template"]["spec"].update(parallelism=trainer["numNodes"], completions=trainer["numNodes"])
            node = rj["template"]["spec"]["template"]["spec"]["containers"][0]
            node.update(image=trainer["image"], command=trainer["command"], env=trainer["env"],
                        resources=trainer["resourcesPerNode"])
    for override in job["spec"]["podTemplateOverrides"]:
        for target in override["targetJobs"]:
            assert target["name"] in jobs, f"override targets {target['name']!r}; the runtime has {sorted(jobs)}"
            pod = jobs[target["name"]]["template"]["spec"]["template"]["spec"]
            pod.setdefault("volumes", []).extend(override["spec"].get("volumes", []))
            containers = {c["name"]: c for c in pod["containers"]}
            for change in override["spec"].get("containers", []):
                assert change["name"] in containers, f"override names container {change['name']!r}: not in the runtime"
                for key in ("env", "volumeMounts"):
                    containers[change["name"]].setdefault(key, []).extend(change.get(key, []))
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": job["metadata"]["name"]},
              "spec": {**copy.deepcopy(runtime["spec"]["template"]["spec"]), "replicatedJobs": list(jobs.values())}}
    validate_crd(jobset, "jobset")
    for rj in jobset["spec"]["replicatedJobs"]:
        validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rj["name"]}, "spec": rj["template"]["spec"]})
