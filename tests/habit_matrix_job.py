"""The habit x strategy matrix's job: the habits torch users bring, in sequence, under one strategy.

    python habit_matrix_job.py OUT                      (one process)
    towers launch --strategy S ... habit_matrix_job.py OUT

Every habit trains its own copy of one small ``nn.Sequential`` classifier (or a generator and a
discriminator) for one epoch of the same 32 examples at a global batch of 8, written as a torch user
writes it, with the step of ``strategy.forward_backward`` (the call that also runs under a pipeline)
inside ``strategy.run``. Each process writes what it trained to ``OUT.rank<r>.pt`` (tensors, numbers and
strings only: the test loads it with ``weights_only=True``): per habit, its results, or the text of the
error the habit stopped on (a refusal). The test compares them with the plain one-device loops.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import towers

ROWS, FEATURES, CLASSES, NOISE, GB = 32, 8, 3, 4, 8
LR, CLIP, EMA_DECAY = 0.3, 0.5, 0.9
HABITS = ("clip", "accumulation", "accumulation_loop", "ema", "ema_helper", "compile", "scheduler", "gan", "eval", "bf16", "copy")


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The examples (features, classes) and each example's generator noise (for the GAN habit)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(ROWS, FEATURES, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    return x, y, torch.randn(ROWS, NOISE, generator=g)


def validation() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(12, FEATURES, generator=g)
    return x, (x[:, 0] > 0).long()


def classifier(outputs: int = CLASSES, seed: int = 0) -> nn.Sequential:
    """The model of every habit: an MLP whose Linear pairs tensor parallelism splits and a pipeline cuts."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, outputs))


def generator() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(NOISE, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, FEATURES))


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def per_example(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, reduction="none")


def whole(t: Any) -> Any:
    """A tensor as one device holds it (a DTensor gathered), on the CPU."""
    if isinstance(t, torch.Tensor):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
    return t


class Job:
    """One strategy, its data, and the habits run on it."""

    def __init__(self, strategy: towers.Strategy):
        self.strategy = strategy
        x, y, z = data()
        self.x, self.y, self.z = x, y, z

    def prepare(self, model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] = sgd) -> Any:
        with self.strategy.scope():
            optimizer = make_optimizer(model)
        return self.strategy.prepare(model, optimizer)

    def weights(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's parameters by name (every shard and stage gathered: a collective); None on a process that
        ``full_state_dict`` gives nothing (FSDP2 gathers onto the chief)."""
        return {k: whole(v) for k, v in self.strategy.full_state_dict(model).items()} or None

    def loss_fn(self, scale: float = 1.0) -> Callable[[Any, Any], torch.Tensor]:
        return lambda out, y: towers.compute_average_loss(per_example(out, y)) / scale

    def train(self, model: nn.Module, optimizer: Any, after_step: Callable[[], None] = lambda: None,
              around: Callable[[], Any] = contextlib.nullcontext) -> None:
        """One epoch: forward_backward, step, zero_grad, then ``after_step`` (the habit's own part)."""
        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            with around():
                self.strategy.forward_backward(model, xb, yb, self.loss_fn())
            optimizer.step()
            optimizer.zero_grad()
            after_step()

        for xb, yb in self.strategy.distribute_dataset((self.x, self.y), GB, shuffle=False):
            self.strategy.run(step, args=(xb, yb))

    # --- the habits ------------------------------------------------------------------------------------------
    def clip(self) -> dict:
        """torch's own clip_grad_norm_ after backward, its norm logged (nanoGPT, Hugging Face loops, torchtitan)."""
        model, optimizer = self.prepare(classifier())
        norms: list[float] = []

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            self.strategy.forward_backward(model, xb, yb, self.loss_fn())
            norms.append(float(whole(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))))
            optimizer.step()
            optimizer.zero_grad()

        for xb, yb in self.strategy.distribute_dataset((self.x, self.y), GB, shuffle=False):
            self.strategy.run(step, args=(xb, yb))
        return {"weights": self.weights(model), "norms": norms}

    def accumulation(self) -> dict:
        """Two batches per update, each loss / 2, DDP's no_sync() on the first where the model has it, one step."""
        model, optimizer = self.prepare(classifier())

        def step(xb: torch.Tensor, yb: torch.Tensor, first: bool) -> None:
            quiet = model.no_sync() if first and hasattr(model, "no_sync") else contextlib.nullcontext()
            with quiet:
                self.strategy.forward_backward(model, xb, yb, self.loss_fn(2.0))
            if not first:
                optimizer.step()
                optimizer.zero_grad()

        batches = self.strategy.distribute_dataset((self.x, self.y), GB // 2, shuffle=False)
        for i, (xb, yb) in enumerate(batches):
            self.strategy.run(step, args=(xb, yb, i % 2 == 0))
        return {"weights": self.weights(model)}

    def accumulation_loop(self) -> dict:
        """The same accumulation in a plain loop (no strategy.run), without no_sync(): the commonest form of it."""
        model, optimizer = self.prepare(classifier())
        batches = self.strategy.distribute_dataset((self.x, self.y), GB // 2, shuffle=False)
        for i, (xb, yb) in enumerate(batches):
            self.strategy.forward_backward(model, xb, yb, self.loss_fn(2.0))
            if i % 2:
                optimizer.step()
                optimizer.zero_grad()
        return {"weights": self.weights(model)}

    def ema(self) -> dict:
        """An EMA of the weights: torch's AveragedModel of the prepared model, updated after every step."""
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        model, optimizer = self.prepare(classifier())
        average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY))
        self.train(model, optimizer, after_step=lambda: average.update_parameters(model))
        return {"weights": self.weights(model),
                "ema": {k: whole(v) for k, v in self.strategy.unwrap(average.module).state_dict().items()}}

    def ema_helper(self) -> dict:
        """The EMA where AveragedModel cannot copy the model: towers.ExponentialMovingAverage, under every strategy."""
        model, optimizer = self.prepare(classifier())
        average = towers.ExponentialMovingAverage(model, decay=EMA_DECAY, strategy=self.strategy)
        self.train(model, optimizer, after_step=average.update)
        return {"weights": self.weights(model), "ema": {k: whole(v) for k, v in average.full_state_dict().items()} or None}

    def compile(self) -> dict:
        """torch.compile of the prepared model (aot_eager: dynamo traces towers' wrappers; no C++ build on CI)."""
        model, optimizer = self.prepare(classifier())
        self.train(torch.compile(model, backend="aot_eager"), optimizer)
        return {"weights": self.weights(model)}

    def scheduler(self) -> dict:
        """An LR scheduler built on the prepared optimizer, stepped after every batch."""
        model, optimizer = self.prepare(classifier())
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        rates: list[float] = []
        self.train(model, optimizer, after_step=lambda: (schedule.step(), rates.append(schedule.get_last_lr()[0])))
        return {"weights": self.weights(model), "rates": rates}

    def gan(self) -> dict:
        """Two models, two optimizers (DCGAN's loop): the discriminator on real and generated rows, then the generator."""
        gen, opt_g = self.prepare(generator())
        disc, opt_d = self.prepare(classifier(outputs=1, seed=2))

        def step(xb: torch.Tensor, zb: torch.Tensor) -> None:
            fake = gen(zb)
            opt_d.zero_grad()
            logits = disc(torch.cat([xb, fake.detach()])).squeeze(1)
            labels = torch.cat([torch.ones(len(xb)), torch.zeros(len(zb))])
            towers.compute_average_loss(F.binary_cross_entropy_with_logits(logits, labels, reduction="none")).backward()
            opt_d.step()
            opt_g.zero_grad()
            guess = disc(fake).squeeze(1)
            towers.compute_average_loss(
                F.binary_cross_entropy_with_logits(guess, torch.ones(len(zb)), reduction="none")).backward()
            opt_g.step()

        for xb, zb in self.strategy.distribute_dataset((self.x, self.z), GB, shuffle=False):
            self.strategy.run(step, args=(xb, zb))
        return {"generator": self.weights(gen), "discriminator": self.weights(disc)}

    def eval(self) -> dict:
        """Evaluation between steps: model.eval(), a validation loss under no_grad, model.train()."""
        model, optimizer = self.prepare(classifier())
        xv, yv = validation()
        losses: list[float] = []

        def evaluate() -> None:
            model.eval()
            with torch.no_grad():
                losses.append(float(whole(per_example(model(xv), yv).mean())))
            model.train()

        self.train(model, optimizer, after_step=evaluate)
        return {"weights": self.weights(model), "losses": losses}

    def bf16(self) -> dict:
        """bf16 autocast around the forward and the loss, as torch's AMP recipe writes it."""
        model, optimizer = self.prepare(classifier())
        self.train(model, optimizer, around=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        return {"weights": self.weights(model)}

    def copy(self) -> dict:
        """After training: copy.deepcopy of the model (its outputs) and torch.save of its state_dict (read back)."""
        model, optimizer = self.prepare(classifier())
        self.train(model, optimizer)
        xv, _ = validation()
        out: dict = {"weights": self.weights(model)}
        twin = copy.deepcopy(model)
        with torch.no_grad():
            out["copy outputs"] = whole(twin(xv))
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        buffer.seek(0)
        out["saved"] = {k: whole(v) for k, v in torch.load(buffer, weights_only=True).items()}
        return out


def main() -> None:
    out = sys.argv[1]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else HABITS
    strategy = towers.strategy_from_env()
    job = Job(strategy)
    results: dict[str, Any] = {"replicas": strategy.num_replicas_in_sync}
    for habit in only:
        try:
            results[habit] = getattr(job, habit)()
        except Exception as exc:  # noqa: BLE001 (a refusal: the text is the result; the next habit still runs)
            results[habit] = f"error: {type(exc).__name__}: {exc}"
    torch.save(results, f"{out}.rank{int(os.environ.get('RANK', '0'))}.pt")
    strategy.shutdown()


if __name__ == "__main__":
    main()
