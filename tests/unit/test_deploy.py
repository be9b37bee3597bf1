"""towers.deploy: validated DeploySpec, manifests that parse, right replica counts and commands; `towers k8s`."""

from __future__ import annotations

import shlex

import pytest
import yaml

from towers.cli import main
from towers.deploy import (
    DeploySpec,
    render,
    render_indexed_job,
    render_pytorchjob,
    render_sbatch,
    render_trainjob,
    to_yaml,
    to_yaml_documents,
)


def job(**kwargs) -> DeploySpec:
    base = {"name": "digits", "image": "ghcr.io/me/train:1.0", "nnodes": 3, "nproc_per_node": "4",
            "gpus_per_node": 4, "script": "train.py", "script_args": ("--epochs", "5")}
    return DeploySpec(**{**base, **kwargs})


def launch_words(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[0] == "exec"
    return words[1:]


# --- YAML writer ------------------------------------------------------------------------------
def test_to_yaml_round_trips_through_a_yaml_parser():
    doc = {"a": "yes", "b": "1.0", "c": "x: y", "d": [1, {"e": None, "f": True}], "g": {}, "h": [],
           "i": 'quote " and $VAR', "nested": [[1, 2], []], "nvidia.com/gpu": 4,
           "numberlike": [".5", ".inf", "-.inf", ".nan", "1e3", "0o17", "0x1F", "012", "1_000", "~", "null", "on"],
           "numbers": [0.5, 1e-05, float("inf"), -3, 12]}
    assert yaml.safe_load(to_yaml(doc)) == doc
    assert list(yaml.safe_load_all(to_yaml_documents([doc, {"k": 1}]))) == [doc, {"k": 1}]


# --- PyTorchJob -------------------------------------------------------------------------------
def test_pytorchjob_replicas_resources_and_command():
    claim, pj = render_pytorchjob(job(strategy="multi_worker_mirrored"))
    assert claim["kind"] == "PersistentVolumeClaim" and claim["metadata"]["name"] == "digits-ckpt"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert (pj["apiVersion"], pj["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = pj["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    for replica in replicas.values():
        assert replica["restartPolicy"] == "OnFailure"  # a preempted pod (exit 75) is started again
        pod = replica["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 60  # time for every rank to save on SIGTERM
        container = pod["containers"][0]
        assert container["name"] == "pytorch" and container["image"] == "ghcr.io/me/train:1.0"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
        assert {"name": "TOWERS_CHECKPOINT_DIR", "value": "/checkpoints"} in container["env"]
        assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "digits-ckpt"}} in pod["volumes"]
        assert container["command"][:2] == ["sh", "-c"]
        words = launch_words(container["command"][2])
        assert words[:2] == ["towers", "launch"]
        flags = dict(zip(words[2:12:2], words[3:12:2]))
        assert flags == {"--nnodes": "3", "--nproc-per-node": "4", "--rdzv-backend": "c10d",
                         "--rdzv-endpoint": "${MASTER_ADDR}:${MASTER_PORT}", "--rdzv-id": "digits"}
        assert words[-5:] == ["--strategy", "multi_worker_mirrored", "train.py", "--epochs", "5"]


def test_single_node_pytorchjob_has_no_workers_and_existing_claim_is_not_rendered():
    docs = render_pytorchjob(job(nnodes=1, checkpoint_pvc="shared-ckpt", gpus_per_node=0))
    assert len(docs) == 1
    (pj,) = docs
    assert list(pj["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    container = pj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert "resources" not in container


def test_ps_strategy_is_passed_with_its_num_ps():
    (_, pj) = render_pytorchjob(job(strategy="parameter_server", num_ps=2))
    command = pj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"][2]
    assert "--strategy ps --num-ps 2 train.py" in command


# --- Indexed Job ------------------------------------------------------------------------------
def test_indexed_job_service_and_rendezvous_on_pod_zero():
    claim, service, job_ = render_indexed_job(job(port=29555, module=True, script="pkg.train"))
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"job-name": "digits"}
    assert service["spec"]["publishNotReadyAddresses"] is True
    spec = job_["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "digits" and pod["restartPolicy"] == "OnFailure"
    assert pod["terminationGracePeriodSeconds"] == 60
    words = launch_words(pod["containers"][0]["command"][2])
    assert "--rdzv-endpoint" in words and words[words.index("--rdzv-endpoint") + 1] == "digits-0.digits:29555"
    assert words[-4:] == ["-m", "pkg.train", "--epochs", "5"]


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob", "indexed-job"])
def test_rendered_yaml_parses(kind):
    text = render(job(env={"NCCL_DEBUG": "INFO"}, memory_per_node="64Gi", cpus_per_node="16"), kind)
    docs = list(yaml.safe_load_all(text))
    expected = {"trainjob": render_trainjob, "pytorchjob": render_pytorchjob, "indexed-job": render_indexed_job}[kind]
    assert docs == expected(job(env={"NCCL_DEBUG": "INFO"}, memory_per_node="64Gi", cpus_per_node="16"))


# --- SLURM ------------------------------------------------------------------------------------
def test_sbatch_script():
    text = render_sbatch(job(partition="gpu", time_limit="04:00:00", memory_per_node="64Gi", cpus_per_node="16"))
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in ("--nodes=3", "--ntasks-per-node=1", "--gpus-per-node=4", "--partition=gpu",
                      "--time=04:00:00", "--mem=64G", "--cpus-per-task=16", "--requeue"):
        assert f"#SBATCH {directive}" in lines
    assert "head_port=$(( 15000 + SLURM_JOB_ID % 20000 ))" in lines
    (srun,) = [line for line in lines if line.startswith("srun ")]
    assert "--cpus-per-task=16" in srun.split(" towers launch")[0]  # srun does not inherit it from sbatch
    assert '--nnodes "$SLURM_NNODES"' in srun and '--rdzv-endpoint "$head_node:$head_port"' in srun
    assert srun.endswith("--max-restarts 3 train.py --epochs 5 || status=$?")
    # a preemption warning reaches every node's launcher 60 s ahead; a preempted job (75, or 143) is requeued
    assert "#SBATCH --signal=TERM@60" in lines
    assert 'if [ "${status:-0}" -eq 75 ] || [ "${status:-0}" -eq 143 ]; then' in lines
    assert '    scontrol requeue "$SLURM_JOB_ID"' in lines and lines[-1] == 'exit "${status:-0}"'
    assert "#SBATCH --signal=TERM@120" in render_sbatch(job(grace_period_s=120)).splitlines()
    assert 'export TOWERS_CHECKPOINT_DIR="$SLURM_SUBMIT_DIR/checkpoints/digits"' in lines


def test_sbatch_needs_no_image():
    assert "#SBATCH --nodes=3" in render(job(image=None), "slurm")


# --- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"name": "Digits_Job"}, r"DNS-1123 label.*Received: 'Digits_Job'. Example: 'digits-job'"),
    ({"name": "-x"}, "DNS-1123"),
    ({"name": "a" * 46}, "at most 45 characters"),
    ({"namespace": "Team A"}, "--namespace must be a DNS-1123 label"),
    ({"image": "my image"}, "--image must be a container image"),
    ({"nnodes": 0}, "--nnodes must be an integer >= 1"),
    ({"nproc_per_node": "8"}, "more than --gpus-per-node 4"),
    ({"nproc_per_node": "gpu", "gpus_per_node": 0}, "--nproc-per-node gpu needs --gpus-per-node"),
    ({"nproc_per_node": "lots"}, "--nproc-per-node must be"),
    ({"strategy": "nope"}, "Unknown strategy"),
    ({"strategy": "mirrored", "num_ps": 1}, "--num-ps only applies"),
    ({"memory_per_node": "64 GB"}, "Kubernetes quantity"),
    ({"checkpoint_pvc": "Bad_PVC"}, "--checkpoint-pvc must be a DNS-1123 subdomain"),
    ({"checkpoint_dir": "ckpt"}, "--checkpoint-dir must be an absolute path"),
    ({"env": {"BAD-NAME": "1"}}, "--env names"),
    ({"port": 80}, "--port must be in 1024..65535"),
    ({"script": ""}, "needs a script"),
])
def test_deploy_spec_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        job(**kwargs)


def test_kubernetes_kind_needs_an_image():
    with pytest.raises(ValueError, match="--image is required for --kind pytorchjob"):
        render(job(image=None), "pytorchjob")


# --- the CLI ----------------------------------------------------------------------------------
def test_cli_prints_and_writes(tmp_path, capsys):
    argv = ["k8s", "--name", "digits", "--image", "img:1", "--nnodes", "2", "--nproc-per-node", "4",
            "--gpus-per-node", "4", "train.py", "--epochs", "5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "kind: TrainJob" in out and "numNodes: 2" in out and "--epochs 5" in out
    assert main([*argv[:1], "--kind", "pytorchjob", *argv[1:]]) == 0
    out = capsys.readouterr().out
    assert "kind: PyTorchJob" in out and "replicas: 1" in out and "--epochs 5" in out
    target = tmp_path / "job.yaml"
    assert main([*argv[:1], "--kind", "indexed-job", "-o", str(target), *argv[1:]]) == 0
    assert "completionMode: Indexed" in target.read_text()
    assert "wrote indexed-job" in capsys.readouterr().err


def test_cli_errors_are_one_line_with_exit_code_2(capsys):
    assert main(["k8s", "--name", "Bad_Name", "--image", "i", "t.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("towers k8s: error: --name must be a DNS-1123 label") and err.count("\n") == 1
    assert main(["k8s", "--name", "ok", "--env", "NOEQUALS", "--image", "i", "t.py"]) == 2
    assert "--env expects KEY=VALUE" in capsys.readouterr().err


def test_cli_refuses_a_strategy_option_the_strategy_does_not_take_before_writing(tmp_path, capsys):
    from towers.cluster.info import ProcessInfo
    from towers.cluster.strategy_options import parse_strategy_options
    from towers.strategies.base import strategy_from_env

    target = tmp_path / "job.yaml"
    argv = ["k8s", "--name", "ok", "--image", "i", "--nnodes", "2", "--strategy", "mirrored", "--strategy-option",
            "nonsense=1", "-o", str(target), "t.py"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not target.exists(), err
    # The same line every process of `towers launch --strategy mirrored --strategy-option nonsense=1` would end on.
    with pytest.raises(ValueError) as launched:
        strategy_from_env(ProcessInfo(strategy="mirrored", strategy_options=parse_strategy_options(["nonsense=1"])))
    assert err == f"towers k8s: error: {launched.value}\n"
    assert "Strategy 'mirrored' does not take the option 'nonsense'" in err and "Drop it" in err
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(0)\n")  # never started: towers launch refuses the option before any process
    assert main(["launch", "--nproc-per-node", "2", "--strategy", "mirrored", "--strategy-option", "nonsense=1",
                 str(script)]) == 2
    assert capsys.readouterr().err == f"towers launch: error: {launched.value}\n"
    ok = ["k8s", "--name", "ok", "--image", "i", "--nnodes", "2", "--strategy", "ps", "--strategy-option", "mode=async",
          "-o", str(target), "t.py"]
    assert main(ok) == 0 and "--strategy-option mode=async" in target.read_text()
