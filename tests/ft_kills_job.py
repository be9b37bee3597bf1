"""One replica group of a fault-tolerant ``Trainer.fit`` job killed again and again, for tests/distributed/test_ft_kills.py.

    towers launch --strategy ft --nproc-per-node 2 --ledger RUN ft_kills_job.py OUT_DIR PLAN_JSON [--epochs E]

The script is the one users write (``Trainer(...).fit(dataset, epochs=E, global_batch_size=32)``),
plus a plan of kills read from ``PLAN_JSON``: a list of ``{"group": G, "phase": P, "after": D}``,
done in order. Kill ``k`` is made by the process of group ``G`` that ``towers launch`` started
``r`` times before (``TOWERS_GROUP_RESTART``), where ``r`` counts the plan's earlier kills of ``G``:
once the group restarted after kill ``k - 1`` has trained a step with both groups (its mark
``joined-<k-1>`` in OUT_DIR/marks), it counts ``D`` steps with both groups, then SIGKILLs itself at
the next moment ``P`` of a step:

``between``  between two steps, once the next one's quorum formed (``on_train_batch_begin``);
``forward``  in the loss, during the forward pass;
``backward`` during the backward pass, before the gradients are summed over the groups;
``commit``   after the step's commit vote said yes, before the optimizer's update and the ledger's line;
``recorded`` after the step was recorded in the ledger (``on_train_batch_end``).

The last kill of the plan (``"after": "end"``) comes at moment ``P`` of the job's last step instead,
so its group is started again after the survivor ended (the job must be long enough for the kills
before it: the test says so when it was not). Each kill first writes ``killed-<k>`` and prints
``killing group G at P of step S (kill k)``. A survivor alone after
a step holds until the group restarted after the latest kill asks for its first quorum (its mark
``asking-<k>``): the lighthouse then puts both in the next quorum, where a survivor stepping flat out
alone would train many steps before the restarted group is in one. At the end a process writes
OUT_DIR/final.pt (its parameters), OUT_DIR/summary.json (its History and steps) and prints ``done T``
(``time.time()``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import towers
from ft_support import end_job
from ft_trainer_job import GLOBAL_BATCH_SIZE, dataset, model_and_optimizer

STEPS_PER_EPOCH = 16  # of ft_trainer_job's data and global batch, whose model and optimizer this job trains too
PHASES = ("between", "forward", "backward", "commit", "recorded")
HOLD_DEADLINE_S = 60.0


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Kills(towers.callbacks.Callback):
    """This process's part of the plan: its kill (if any), the marks it writes, and the survivor's hold."""

    def __init__(self, plan: list[dict[str, Any]], group: int, restart: int, marks: Path, last_step: int) -> None:
        super().__init__()
        self.plan, self.group, self.marks, self.last_step = plan, group, marks, last_step
        mine = [k for k, kill in enumerate(plan) if kill["group"] == group]
        self.kill = mine[restart] if restart < len(mine) else None  # the plan's index of this process's kill
        self.back_from = mine[restart - 1] if 0 < restart <= len(mine) else None  # the kill it is the restart after
        self.last = self.kill is not None and plan[self.kill]["after"] == "end"
        self.counted = 0
        self.due = False
        self.asked = self.joined = False

    def _mark(self, name: str, text: str = "") -> None:
        tmp = self.marks / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(self.marks / name)

    def _armed(self) -> bool:
        return self.kill is not None and (self.kill == 0 or (self.marks / f"joined-{self.kill - 1}").exists())

    def at(self, phase: str) -> None:
        """SIGKILL this process when its kill is due at ``phase``."""
        if not self.due or self.kill is None or self.plan[self.kill]["phase"] != phase:
            return
        step = self.trainer.strategy.current_step
        self._mark(f"killed-{self.kill}", f"{time.time():.4f}")
        _say(f"killing group {self.group} at {phase} of step {step} (kill {self.kill})")
        os.kill(os.getpid(), signal.SIGKILL)

    def asking(self) -> None:
        """Called as this process asks for a step's quorum: the restarted group's first one frees the survivor."""
        if self.back_from is not None and not self.asked:
            self.asked = True
            self._mark(f"asking-{self.back_from}")

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.last and self._armed():
            self.due = self.trainer.strategy.current_step == self.last_step  # the job's last step
        self.at("between")

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.at("recorded")
        groups = self.trainer.strategy.live_replicas
        if groups == 2 and self.back_from is not None and not self.joined:
            self.joined = True
            self._mark(f"joined-{self.back_from}")
        if groups == 2 and self._armed() and not self.last:
            self.counted += 1
            self.due = self.counted >= self.plan[self.kill]["after"]
        if groups == 1:
            self._hold()

    def _hold(self) -> None:
        """Alone: wait until the group being restarted after the latest kill asks for its first quorum (never after
        the last kill). Once that group's request waits at the lighthouse, the survivor's next quorum takes it in."""
        killed = [k for k in range(len(self.plan)) if (self.marks / f"killed-{k}").exists()]
        if not killed or killed[-1] == len(self.plan) - 1:
            return
        deadline = time.monotonic() + HOLD_DEADLINE_S
        while not (self.marks / f"asking-{killed[-1]}").exists():  # written by the restarted process: an event
            if time.monotonic() > deadline:
                raise SystemExit(f"group {self.group}: the group restarted after kill {killed[-1]} did not ask for a "
                                 f"quorum within {HOLD_DEADLINE_S} s")
            time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("plan")
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out, plan = Path(args.out), json.loads(Path(args.plan).read_text())
    (out / "marks").mkdir(exist_ok=True)

    strategy = towers.strategy_from_env()
    group, restart = strategy.replica_group_id, int(os.environ.get("TOWERS_GROUP_RESTART", "0"))
    kills = Kills(plan, group, restart, out / "marks", args.epochs * STEPS_PER_EPOCH - 1)
    ask_for_quorum = strategy.begin_step

    def begin_step() -> None:  # the strategy's own, with the restarted group's mark that it asks now
        kills.asking()
        ask_for_quorum()

    strategy.begin_step = begin_step  # type: ignore[method-assign]
    net, optimizer = model_and_optimizer(group + 10 * restart)  # not the job's weights: a restart must heal
    optimizer.register_step_pre_hook(lambda *_: kills.at("commit"))  # runs once the commit vote said yes

    def loss(y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        kills.at("forward")
        if y_pred.requires_grad:
            y_pred.register_hook(lambda grad: kills.at("backward"))  # backward reaches the logits first
        return nn.functional.cross_entropy(y_pred, y, reduction="none")

    trainer = towers.Trainer(net, optimizer, loss=loss, strategy=strategy, log_every_n_steps=4)
    history = trainer.fit(dataset(), epochs=args.epochs, global_batch_size=GLOBAL_BATCH_SIZE, callbacks=[kills])
    torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, out / "final.pt")
    summary = {"group": group, "restart": restart, "epochs": history.epoch, "examples": history.history["examples"],
               "global_step": trainer.progress.global_step, "job_step": strategy.current_step,
               "not_committed": strategy.steps_not_committed}
    (out / "summary.json").write_text(json.dumps(summary))
    _say(f"done {time.time():.4f} {json.dumps(summary)}")
    end_job(strategy)


if __name__ == "__main__":
    main()
