"""An ``sbatch`` script for a multi-machine job: one ``towers launch`` per node through ``srun``.

The rendezvous is c10d on the allocation's first host, on port ``15000 + SLURM_JOB_ID % 20000``
(the formula ``towers.cluster`` uses for SLURM), unless ``port`` is given. ``--requeue`` lets SLURM
requeue a preempted job; with checkpoints in ``TOWERS_CHECKPOINT_DIR`` it resumes where it stopped.
``--signal=TERM@<grace>`` warns every node's ``towers launch`` that long before the time limit: the
ranks save at the next step they agree on and exit with code 75, and the script requeues the job.
"""

from __future__ import annotations

import re
import shlex

from towers.cluster.slurm import SLURM_PORT_BASE, SLURM_PORT_SPAN
from towers.deploy.spec import DeploySpec
from towers.errors import InvalidArgumentError

__all__ = ["render_sbatch"]


def _slurm_memory(quantity: str) -> str:
    # Kubernetes "32Gi" -> SLURM "32G"; SLURM takes K/M/G/T suffixes (binary units).
    match = re.fullmatch(r"([0-9]+)(k|Ki|M|Mi|G|Gi|T|Ti)?", quantity)
    if match is None:
        raise InvalidArgumentError(f"--memory-per-node for SLURM must be a whole amount such as '64Gi' or '64G'. "
                                   f"Received: {quantity!r}.")
    number, unit = match.groups()
    return number + (unit[0].upper() if unit else "M")


def render_sbatch(spec: DeploySpec) -> str:
    """Return the text of an sbatch script that runs ``spec`` on ``spec.nnodes`` nodes."""
    directives = [
        f"--job-name={spec.name}",
        f"--nodes={spec.nnodes}",
        "--ntasks-per-node=1",
        f"--output={spec.name}-%j.out",
        "--requeue",
        f"--signal=TERM@{spec.grace_period_s}",
    ]
    if spec.gpus_per_node:
        directives.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.cpus_per_node:
        if not spec.cpus_per_node.isdigit():
            raise InvalidArgumentError("--cpus-per-node for SLURM must be a whole number of CPUs. Received: "
                                       f"{spec.cpus_per_node!r}.")
        directives.append(f"--cpus-per-task={spec.cpus_per_node}")
    if spec.memory_per_node:
        directives.append(f"--mem={_slurm_memory(spec.memory_per_node)}")
    if spec.partition:
        directives.append(f"--partition={spec.partition}")
    if spec.time_limit:
        directives.append(f"--time={spec.time_limit}")
    cpus = f" --cpus-per-task={spec.cpus_per_node}" if spec.cpus_per_node else ""
    checkpoint_dir = spec.checkpoint_dir or f"$SLURM_SUBMIT_DIR/checkpoints/{spec.name}"
    port = str(spec.port) if spec.port else f"$(( {SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN} ))"
    launch = spec.launch_command(nnodes='"$SLURM_NNODES"', rdzv_endpoint='"$head_node:$head_port"',
                                 rdzv_id='"$SLURM_JOB_ID"')
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        f"# {spec.name}: {spec.nnodes} node(s) x {spec.nproc_per_node} process(es), rendered by `towers k8s "
        "--kind slurm`.",
        "# Submit with: sbatch <this file>",
        "set -euo pipefail",
        "",
        "# The rendezvous runs on the allocation's first host; every node's `towers launch` joins it.",
        "# (awk reads the whole list: `| head -n 1` would end scontrol with SIGPIPE, fatal under pipefail.)",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk \'NR == 1\')',
        f"head_port={port}",
        f'export TOWERS_CHECKPOINT_DIR="{checkpoint_dir}"',
        'mkdir -p "$TOWERS_CHECKPOINT_DIR"',
        *(f"export {k}={shlex.quote(v)}" for k, v in spec.env.items() if k != "TOWERS_CHECKPOINT_DIR"),
        "",
        "# One task per node; --kill-on-bad-exit ends the other nodes when one node's launcher fails.",
        "# srun does not inherit --cpus-per-task from sbatch (SLURM >= 22.05): it is passed again.",
        "# A preemption notice (the --signal above, or scancel --signal=TERM) makes every rank save at one step",
        "# and exit with code 75 (143 for the launcher that got the signal): requeue, and the job resumes there.",
        f"srun --kill-on-bad-exit=1 --ntasks-per-node=1{cpus} {launch} || status=$?",
        'if [ "${status:-0}" -eq 75 ] || [ "${status:-0}" -eq 143 ]; then',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "${status:-0}"',
        "",
    ]
    return "\n".join(lines)
