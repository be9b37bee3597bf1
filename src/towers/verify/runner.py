"""The process ``towers verify`` starts for each replica: ``python -m towers.verify.runner [--plain] script.py [args]``.

Before the user's script runs (``runpy``, as ``python script.py`` would, unchanged), it

- turns dropout off: ``F.dropout`` and its variants return their input and ``scaled_dot_product_attention``
  gets ``dropout_p=0``, so ``nn.Dropout`` modules, Hugging Face attention dropout and nanoGPT's flash
  attention draw no mask (one process and N replicas draw different masks by design);
- counts, per update, the training forwards of the outermost module and the examples they saw (the first
  dimension of the first tensor argument), with a fingerprint of each example (a hash of its row), and notes
  gradient hooks put on parameters and clip calls;
- under ``--plain`` (a script without towers) registers torch's global optimizer step pre-hook, which
  calls ``towers.verify_capture.before_update`` as towers' own optimizers do.

Under ``--plain``, after the script (its end, or the capture's stop after the last recorded update), a
process group the script left open is destroyed while the interpreter is whole: a plain script stopped mid-loop never
reaches its own ``destroy_process_group``, and Gloo then aborted at exit about one run in eight.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import os
import runpy
import sys
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

from towers import verify_capture
from towers.process_group import leave_before_exit

__all__ = ["Recorder", "fingerprints", "turn_dropout_off", "main"]

_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")
_MAX_ROWS = 4096  # example fingerprints kept per update: enough to tell whose examples a replica read


def turn_dropout_off() -> None:
    """Make every dropout of this process an identity (the functional forms ``nn.Dropout`` and models call)."""
    def identity(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return input

    for name in _DROPOUTS:
        setattr(F, name, identity)
    torch.dropout = identity  # type: ignore[assignment]
    attention = F.scaled_dot_product_attention

    @functools.wraps(attention)
    def no_dropout_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                             dropout_p: float = 0.0, *args: Any, **kwargs: Any) -> torch.Tensor:
        return attention(query, key, value, attn_mask, 0.0, *args, **kwargs)

    F.scaled_dot_product_attention = no_dropout_attention  # type: ignore[assignment]


def _first_tensor(args: Sequence[Any]) -> torch.Tensor | None:
    for value in args:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value
    return None


def fingerprints(batch: torch.Tensor, limit: int = _MAX_ROWS) -> list[str]:
    """Return a short hash of each of ``batch``'s first ``limit`` rows (its examples): equal rows, equal hashes."""
    try:
        rows = batch.detach()[:limit].reshape(min(limit, batch.shape[0]), -1).to("cpu").contiguous()
        data = (rows.float() if rows.dtype == torch.bfloat16 else rows).numpy()  # numpy has no bfloat16
    except (RuntimeError, TypeError):  # a tensor subclass or layout numpy cannot read: no fingerprints
        return []
    return [hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest() for row in data]


class Recorder:
    """What the script did between two updates: outermost training forwards, their examples, clips, gradient hooks."""

    def __init__(self) -> None:
        self._depth = 0
        self._counted = True  # the outermost forward in progress has had its examples counted
        self.forwards = 0
        self.examples = 0
        self.rows: list[str] = []  # the fingerprints of the examples counted
        self.clips = 0
        self.grad_hooks = 0  # hooks on parameters' gradients: they run before replicas sum the gradient

    def install(self) -> None:
        """Register the global module hooks and wrap torch's clip functions and ``Tensor.register_hook``."""
        torch.nn.modules.module.register_module_forward_pre_hook(self._pre)
        torch.nn.modules.module.register_module_forward_hook(self._post, always_call=True)
        utils = torch.nn.utils
        for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grad_norm"):
            if hasattr(utils, name):
                setattr(utils, name, self._counting(getattr(utils, name)))
                if hasattr(utils.clip_grad, name):
                    setattr(utils.clip_grad, name, getattr(utils, name))
        register_hook = torch.Tensor.register_hook
        recorder = self

        def counted_register_hook(tensor: torch.Tensor, hook: Callable[..., Any]) -> Any:
            if isinstance(tensor, torch.nn.Parameter):
                recorder.grad_hooks += 1
            return register_hook(tensor, hook)

        torch.Tensor.register_hook = counted_register_hook  # type: ignore[method-assign]

    def _counting(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.clips += 1
            return fn(*args, **kwargs)
        return counted

    def _pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if self._depth == 0 and torch.is_grad_enabled():
            self.forwards += 1
            self._counted = False
        if not self._counted:  # `model(**batch)` passes no tensor positionally: its first layer that gets one counts
            first = _first_tensor(args)
            if first is not None:
                self.examples += int(first.shape[0])
                if len(self.rows) < _MAX_ROWS:
                    self.rows += fingerprints(first, _MAX_ROWS - len(self.rows))
                self._counted = True
        self._depth += 1

    def _post(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def take(self) -> dict[str, Any]:
        """Return what was counted since the last call, and start counting the next update."""
        out = {"forwards": self.forwards, "examples": self.examples, "clips": self.clips, "grad_hooks": self.grad_hooks,
               "rows": self.rows}
        self.forwards = self.examples = self.clips = 0
        self.rows = []
        return out


def main(argv: Sequence[str] | None = None) -> None:
    """Run the script named in ``argv`` (after ``--plain`` / ``--keep-dropout``) under the recorders."""
    argv = list(sys.argv[1:] if argv is None else argv)
    plain = keep_dropout = False
    while argv and argv[0] in ("--plain", "--keep-dropout"):
        flag = argv.pop(0)
        plain, keep_dropout = plain or flag == "--plain", keep_dropout or flag == "--keep-dropout"
    if not argv:
        raise SystemExit("usage: python -m towers.verify.runner [--plain] [--keep-dropout] script.py [args ...]")
    script = argv[0]
    if not keep_dropout:
        turn_dropout_off()
    recorder = Recorder()
    recorder.install()
    verify_capture.add_observer(recorder.take)
    if plain:
        register_optimizer_step_pre_hook(
            lambda optimizer, args, kwargs: verify_capture.before_update(optimizer))
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
        verify_capture.finish()
    finally:
        if plain:  # towers' own process group leaves at exit by itself (towers.process_group)
            _leave_open_group()


def _leave_open_group() -> None:
    # As towers does for its own groups at exit (towers.process_group.leave_before_exit), after freeing what the
    # stopped script still held (its DDP module's last work).
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gc.collect()
        leave_before_exit()


if __name__ == "__main__":
    main()
