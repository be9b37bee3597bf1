"""Work lost per failure: FaultTolerantStrategy (the lost group restarted alone) vs a full restart with BackupAndRestore.

Both run as a user runs them: ``towers launch --nproc-per-node 2`` of the same ``Trainer.fit`` script
(the seed CNN on synthetic 28x28 data, global batch 128, SGD), one as ``--strategy ft``, one as
``--strategy mirrored --max-restarts 1`` with ``BackupAndRestore(save_freq=--backup-every)``.
Each job runs twice per round, without a failure and with rank 1 SIGKILLing itself after global
step ``--kill-at`` (first run only); rounds interleave the four jobs, ``--repeats`` rounds.

Reported, median over rounds:
* time lost per failure: wall time of the job with the failure minus without (the whole job,
  launcher start to exit, as a user waits for it);
* steps computed again: under ft, the steps that did not commit (the step in flight, at most 1);
  under the full restart, the steps between the last backup and the kill, which every replica
  trains again;
* examples lost: 0 in both (the ft survivors take the lost group's share; the restart resumes at
  the backup's exact step).

    python benchmarks/ft_work_lost.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _job(args: argparse.Namespace) -> None:
    """One process of the job: Trainer.fit, rank 1 killing itself after --kill-at on its first run."""
    import torch

    import towers
    from towers.models import SeedCNN

    torch.set_num_threads(1)
    strategy = towers.strategy_from_env()
    first_run = os.environ.get("TOWERS_GROUP_RESTART", "0") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                                                       "0") == "0"
    torch.manual_seed(0)
    net = SeedCNN()
    trainer = towers.Trainer(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                             loss=torch.nn.CrossEntropyLoss(reduction="none"), strategy=strategy)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.examples, 1, 28, 28, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.randint(0, 10, (args.examples,), generator=g))

    class KillAt(towers.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            if args.kill_at and first_run and strategy.process_info.rank == 1 and logs["global_step"] >= args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks = [KillAt()]
    if args.backup_dir:
        callbacks.insert(0, towers.callbacks.BackupAndRestore(args.backup_dir, save_freq=args.backup_every))
    history = trainer.fit(data, epochs=args.epochs, global_batch_size=128, callbacks=callbacks)
    not_committed = getattr(strategy, "steps_not_committed", 0)
    if strategy.process_info.rank == 0:
        print("RESULT " + json.dumps({"examples": history.history["examples"], "not_committed": not_committed}),
              flush=True)
    strategy.shutdown()


def _run(args: argparse.Namespace, strategy: str, kill_at: int, workdir: Path) -> dict:
    backup = workdir / f"backup-{strategy}-{kill_at}-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "towers", "launch", "--nproc-per-node", "2", "--strategy", strategy]
    argv += ["--max-restarts", "1"] if strategy == "mirrored" else []
    argv += [__file__, "--job", "--kill-at", str(kill_at), "--epochs", str(args.epochs), "--examples",
             str(args.examples), "--backup-every", str(args.backup_every)]
    argv += ["--backup-dir", str(backup)] if strategy == "mirrored" else []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if "RESULT " in line)
    result = json.loads(line.split("RESULT ", 1)[1])
    return {"seconds": seconds, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=70, help="global step after which rank 1 is killed (default 70)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--examples", type=int, default=128 * 40, help="examples per epoch (default 40 steps of 128)")
    parser.add_argument("--backup-every", type=int, default=50, help="BackupAndRestore save_freq in steps (default 50)")
    parser.add_argument("--backup-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.job:
        _job(args)
        return
    times: dict[str, list[float]] = {}
    details: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="towers-ft-lost-") as tmp:
        for r in range(args.repeats):
            order = [("fault_tolerant", 0), ("fault_tolerant", args.kill_at), ("mirrored", 0), ("mirrored", args.kill_at)]
            for strategy, kill_at in (order if r % 2 == 0 else order[::-1]):
                result = _run(args, strategy, kill_at, Path(tmp))
                key = f"{strategy} {'kill' if kill_at else 'clean'}"
                times.setdefault(key, []).append(result["seconds"])
                details[key] = result
                print(f"round {r}: {key}: {result['seconds']:.1f} s, examples per epoch {result['examples']}, "
                      f"steps not committed {result['not_committed']}", flush=True)
    median = {key: statistics.median(values) for key, values in times.items()}
    redone_restart = args.kill_at - (args.kill_at // args.backup_every) * args.backup_every
    print(json.dumps({"median_s": median, "runs_s": times}, indent=1))
    print(f"fault_tolerant: {median['fault_tolerant kill'] - median['fault_tolerant clean']:+.1f} s per failure, "
          f"{details['fault_tolerant kill']['not_committed']} step(s) computed again")
    print(f"mirrored + BackupAndRestore(save_freq={args.backup_every}) + --max-restarts 1: "
          f"{median['mirrored kill'] - median['mirrored clean']:+.1f} s per failure, {redone_restart} step(s) computed "
          f"again by every replica (kill after step {args.kill_at}, last backup at step {args.kill_at - redone_restart})")


if __name__ == "__main__":
    main()
