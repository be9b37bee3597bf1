"""One replica's training step traced on fake tensors: how many bytes are live at each moment, without allocating any.

The model (built on the meta device) is given fake CPU tensors (``FakeTensorMode``), then two
steps run (forward, loss, backward, ``optimizer.step()``, ``zero_grad()``): the first creates the
optimizer's state, the second is the one measured. A ``TorchDispatchMode`` sees every tensor an
operation returns and keeps a weak reference to its storage, so a storage counts from the op
that made it until the last tensor on it is gone: exactly when the real allocator would free it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from towers.errors import user_error

__all__ = ["StepTrace", "trace_step", "input_maker", "make_optimizer", "OPTIMIZERS"]

#: Optimizers the plan knows, by name; each is built as torch builds it, over the model's parameters.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    """Return the optimizer ``name`` (one of ``OPTIMIZERS``) over ``params``."""
    return OPTIMIZERS[name](params)


@dataclass(frozen=True)
class StepTrace:
    """Bytes one replica holds during a steady-state step, beyond its parameters and optimizer state.

    ``activations``: the most bytes live during forward and backward that are not gradients (saved
    activations, the batch, temporaries). ``with_gradients``: the most bytes live during forward and
    backward counting the gradients as they are made (a replica without gradient buckets).
    ``optimizer_temporaries``: the most bytes ``optimizer.step()`` adds while it runs. ``gradients``:
    the gradients' bytes after backward. ``saved``: the bytes still live when forward ends (what a
    pipeline stage keeps per micro-batch in flight until its backward).
    """

    activations: int
    with_gradients: int
    optimizer_temporaries: int
    gradients: int
    saved: int = 0


class _LiveBytes(TorchDispatchMode):
    """Logs ``(bytes, storage serial)`` when an op returns a tensor on a new storage, and ``(-bytes, serial)`` when it dies."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []
        self._serials: dict[int, int] = {}  # id of a live storage -> its serial (ids are reused, serials are not)
        self.paused = False  # while True, new storages are not logged (a later pipeline stage's input being made)

    def _died(self, key: int, serial: int, nbytes: int) -> None:
        self._serials.pop(key, None)
        self.events.append((-nbytes, serial))

    def serial(self, tensor: torch.Tensor) -> int | None:
        """Return the serial of ``tensor``'s storage, None when no traced op made it."""
        return self._serials.get(id(tensor.untyped_storage()))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._serials:
                    serial, nbytes = len(self.events), storage.nbytes()
                    self._serials[key] = serial
                    self.events.append((nbytes, serial))
                    weakref.finalize(storage, self._died, key, serial, nbytes)
        return out


def _peak(events: list[tuple[int, int]], skip: set[int] = frozenset()) -> tuple[int, int]:  # type: ignore[assignment]
    """Return (most bytes live at once, bytes live at the end) over ``events``, leaving out the storages in ``skip``."""
    live = peak = 0
    for nbytes, serial in events:
        if serial not in skip:
            live += nbytes
            peak = max(peak, live)
    return peak, live


def _loss(output: Any, loss: str) -> torch.Tensor:
    """The loss of one batch, against random targets shaped for ``output`` (class ids or the output's shape)."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    elif not isinstance(output, torch.Tensor):
        output = output["logits"] if "logits" in output else next(iter(output.values()))
    output = output.float()  # as the strategies hand back mixed-precision outputs
    if loss == "mse":
        return F.mse_loss(output, torch.zeros_like(output))
    logits = output.reshape(-1, output.shape[-1])
    return F.cross_entropy(logits, torch.randint(0, output.shape[-1], (logits.shape[0],)))


def trace_step(model: nn.Module, make_batch: Callable[[], Any], *, optimizer: str, loss: str,
               autocast_dtype: torch.dtype | None, forward: Callable[[Any], Any] | None = None, last: bool = True,
               materialize: nn.Module | None = None) -> StepTrace:
    """Run two training steps of ``model`` (on the meta device; it is moved to fake tensors) and return the second's bytes.

    ``make_batch()`` returns the model's input (a tensor, or a dict of keyword arguments); it is
    called under fake tensors, so it allocates nothing, and its own work is not counted (only the
    input it returns, copied). A pipeline stage: ``forward(batch)`` runs the stage (default:
    ``model(batch)``), ``last=False`` runs backward from a gradient shaped like the output (what the
    next stage sends back) instead of a loss, and ``materialize`` is the whole model (the earlier
    stages ``make_batch`` runs).
    """
    run = forward or (lambda batch: model(**batch) if isinstance(batch, dict) else model(batch))
    with FakeTensorMode(allow_non_fake_inputs=True):
        (materialize or model).to_empty(device="cpu")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(optimizer, params)
        tracker = _LiveBytes()
        with tracker:
            for _ in range(2):  # the first step makes the optimizer's state; the second is the steady state
                tracker.paused = True
                made = make_batch()
                tracker.paused = False
                first = len(tracker.events)
                batch = _copy_input(made, needs_grad=not last or forward is not None)
                del made
                with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                    output = run(batch)
                forwarded = len(tracker.events)
                if last:
                    _loss(output, loss).backward()
                else:
                    output.backward(torch.ones_like(output))
                del output, batch
                grads = {s for s in (tracker.serial(p.grad) for p in params if p.grad is not None) if s is not None}
                backward = tracker.events[first:]
                saved = _peak(tracker.events[first:forwarded])[1]
                stepped = len(tracker.events)
                opt.step()
                step = tracker.events[stepped:]
                opt.zero_grad(set_to_none=True)
    with_gradients, _ = _peak(backward)
    activations, _ = _peak(backward, grads)
    gradients = sum(nbytes for nbytes, serial in backward if serial in grads and nbytes > 0)
    return StepTrace(activations=activations, with_gradients=with_gradients,
                     optimizer_temporaries=_peak(step)[0], gradients=gradients, saved=saved)


def _copy_input(batch: Any, *, needs_grad: bool) -> Any:
    """The input as the step holds it: a copy (counted), float tensors taking gradients when a stage sends them back."""
    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        c = t.detach().clone()
        return c.requires_grad_() if needs_grad and c.is_floating_point() else c

    if isinstance(batch, dict):
        return {k: copy(v) for k, v in batch.items()}
    return copy(batch)


def input_maker(model: nn.Module, batch: int, *, input_shape: tuple[int, ...] | None, seq_len: int | None,
                vocab_size: int | None) -> Callable[[], Any]:
    """Return ``make_batch()`` for ``trace_step``: ``batch`` examples of ``input_shape`` (floats), or of ``seq_len``
    token ids below ``vocab_size`` (default: ``model``'s first ``nn.Embedding``'s size).

    Raises:
        ValueError: neither shape, a bad ``seq_len`` or ``vocab_size``, or token inputs without a vocabulary size.
    """
    if seq_len is not None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise user_error("seq_len (--seq-len) must be a positive number of tokens per example", f"seq_len={seq_len!r}",
                             "Pass the sequence length the model trains on, e.g. --seq-len 256.")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
            raise user_error("vocab_size (--vocab-size) must be a positive number of token ids",
                             f"vocab_size={vocab_size!r}", "Pass e.g. --vocab-size 50257, or leave it out to use the "
                             "model's first nn.Embedding's size.")
        if vocab_size is None:
            vocab_size = next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if vocab_size is None:
            raise user_error("Token inputs need a vocabulary size, and the model has no nn.Embedding to take it from",
                             f"seq_len={seq_len!r}, vocab_size=None", "Pass --vocab-size.")
        shape, vocab = (batch, seq_len), vocab_size

        def tokens() -> Any:
            return torch.randint(0, vocab, shape)
        return tokens
    if input_shape:
        dims = (batch, *input_shape)

        def floats() -> Any:
            return torch.randn(dims)
        return floats
    raise user_error("The plan needs the shape of one input", "neither input_shape nor seq_len",
                     "Pass --input-shape C,H,W for float inputs or --seq-len L for token ids.")
