"""Where training is (``TrainingProgress``) and the Trainer's state in the checkpoint format."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from towers._logging import get_logger
from towers._rng import replica_rng_state
from towers.checkpoint import state as ckpt

if TYPE_CHECKING:
    from towers.training._steps import MetricSet
    from towers.training.trainer import Trainer

__all__ = ["TrainingProgress", "capture_state", "restore_state"]

log = get_logger(__name__)


@dataclass(frozen=True)
class TrainingProgress:
    """``epoch`` in progress (0-based), ``step``s and ``examples`` of it done, ``global_step`` since the start."""

    epoch: int = 0
    step: int = 0
    examples: int = 0
    global_step: int = 0
    global_batch_size: int = 0
    seed: int = 0

    def after_step(self, examples: int) -> "TrainingProgress":
        """Return the progress after one more step of ``examples`` global examples."""
        return replace(self, step=self.step + 1, examples=self.examples + examples, global_step=self.global_step + 1)

    def next_epoch(self) -> "TrainingProgress":
        """Return the progress at the start of the next epoch."""
        return replace(self, epoch=self.epoch + 1, step=0, examples=0)

    def resized(self, global_batch_size: int) -> "TrainingProgress":
        """Return the same position for a run with ``global_batch_size``, at the last global-batch boundary."""
        if global_batch_size == self.global_batch_size or self.examples == 0:
            return replace(self, global_batch_size=global_batch_size)
        step = self.examples // global_batch_size
        log.warning("resuming with global_batch_size=%d (checkpoint: %d): %d examples of epoch %d were done; "
                    "resuming after %d global batches (%d examples), so %d examples are seen twice",
                    global_batch_size, self.global_batch_size, self.examples, self.epoch, step,
                    step * global_batch_size, self.examples - step * global_batch_size)
        return replace(self, step=step, examples=step * global_batch_size, global_batch_size=global_batch_size)


def capture_state(trainer: "Trainer", *, train_input: Any, callbacks: Iterable[Any],
                  train_metrics: MetricSet) -> dict[str, Any]:
    """Return ``trainer``'s full state in the checkpoint format (a collective: gathers every replica's RNG).

    ``train_input``, ``callbacks`` and ``train_metrics`` are the fit's (its metric sums already reduced).
    """
    strategy, p = trainer.strategy, trainer.progress
    rng = strategy.all_gather_object(ckpt.rng_state())
    dataset_state = train_input.state_dict() if callable(getattr(train_input, "state_dict", None)) else None
    saved_callbacks = {}
    for i, cb in enumerate(callbacks):
        if cb is not trainer.history and callable(getattr(cb, "state_dict", None)):
            saved_callbacks[f"{i}:{type(cb).__name__}"] = cb.state_dict()
    training = strategy.state_dict(trainer.model, trainer.optimizer)
    return {
        "model": training["model"],
        "optimizer": training["optimizer"],
        "precision": training.get("precision", {}),
        "epoch": p.epoch,
        "step": p.step,
        "global_step": p.global_step,
        "data": {"epoch": p.epoch, "examples": p.examples, "global_batch_size": p.global_batch_size,
                 "seed": p.seed, "state": dataset_state},
        "rng": list(rng),
        "metrics": {m.name: m.state_dict() for m in train_metrics.all() if hasattr(m, "state_dict")},
        "history": trainer.history.state_dict(),
        "callbacks": saved_callbacks,
    }


def restore_state(trainer: "Trainer", state: Mapping[str, Any], *, train_metrics: MetricSet,
                  path: str = "<state>") -> dict[str, Any]:
    """Check that ``state`` fits ``trainer``, then restore model, optimizer, scaler, history and ``train_metrics``.

    ``state`` holds the model and optimizer as ``strategy.state_dict`` gives them (laid out for
    this job, as ``towers.checkpoint.api.read_into`` reads them; their keys and shapes are checked
    there). Returns what ``fit`` applies when it starts: ``{"progress", "rng", "callbacks"}``.
    Nothing is changed when a check fails.

    Raises:
        CheckpointError: naming the file and what does not fit.
    """
    optimizer = trainer.optimizer
    _check_fits(train_metrics, state, path)
    try:  # the optimizer loads first, and torch checks it before it changes anything
        trainer.strategy.load_state_dict({"model": state["model"], "optimizer": state.get("optimizer"),
                                          "precision": state.get("precision", {})}, trainer.model, optimizer)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise ckpt.CheckpointError(f"Checkpoint {path} does not fit this model/optimizer: {exc}. "
                                   "Build the same model and optimizer (same parameter groups) that wrote it.") from exc
    trainer.history.load_state_dict(state.get("history", {}))
    saved_metrics = state.get("metrics", {})
    for m in train_metrics.all():
        if m.name in saved_metrics and hasattr(m, "load_state_dict"):
            m.load_state_dict(saved_metrics[m.name])
    data = state["data"]
    progress = TrainingProgress(epoch=int(state["epoch"]), step=int(state["step"]), examples=int(data["examples"]),
                                global_step=int(state["global_step"]), global_batch_size=int(data["global_batch_size"]),
                                seed=int(data.get("seed", 0)))
    rngs = list(state["rng"])
    n_saved, n_now, me = len(rngs), trainer.strategy.num_replicas_in_sync, trainer.strategy.replica_id
    if n_saved != n_now:
        log.warning("checkpoint %s was written by %d replicas, this job has %d: model and optimizer are restored as "
                    "they were; data resumes at the same example, RNG streams are those of saved replica r %% %d "
                    "(forked for the replicas it did not have)", path, n_saved, n_now, n_saved)
    log.info("restored %s: epoch %d, step %d (global step %d)", path, progress.epoch, progress.step, progress.global_step)
    return {"progress": progress, "rng": replica_rng_state(rngs, me) if rngs else None,
            "callbacks": dict(state.get("callbacks", {}))}


def _check_fits(train_metrics: MetricSet, state: Mapping[str, Any], path: str) -> None:
    for key in ("model", "epoch", "step", "global_step", "data", "rng"):
        if key not in state:
            raise ckpt.CheckpointError(f"Checkpoint {path} lacks {key!r}: it is not a full training checkpoint.")
    data = state["data"]
    if not isinstance(data, Mapping) or "examples" not in data or "global_batch_size" not in data:
        raise ckpt.CheckpointError(f"Checkpoint {path} has no data position (data={data!r}).")
    names = {m.name for m in train_metrics.all()}
    unknown = sorted(set(state.get("metrics", {})) - names)
    if unknown:
        log.warning("checkpoint %s has running sums for metrics this Trainer lacks: %s (ignored)", path, unknown)
