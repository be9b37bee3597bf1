"""Whether a checkpoint fits this job's model and optimizer, checked before anything loads."""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
from torch import nn

from towers.checkpoint.state import CheckpointError, global_shape

__all__ = ["check_model_fits", "check_plain_module"]


def _saved_shapes(manifest: Mapping[str, Any], shapes: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``{state key: global shape or None}`` of the entries saved under ``manifest["state"][key]``."""
    out: dict[str, Any] = {}
    plain = manifest["state"].get(key)
    for name, value in (plain.items() if isinstance(plain, Mapping) else ()):
        out[name] = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    for tensor_path, flat in manifest["tensors"]:
        if tensor_path[0] == key and len(tensor_path) >= 2:
            out[tensor_path[1]] = tuple(shapes[flat][0]) if len(tensor_path) == 2 and flat in shapes else None
    return out


def check_model_fits(path: str | os.PathLike[str], manifest: Mapping[str, Any], shapes: Mapping[str, Any],
                     live: Mapping[str, Any], *, key: str, strategy_name: str, optimizer_key: str | None = None,
                     has_optimizer: bool = False) -> None:
    """Raise ``CheckpointError`` unless the model (and optimizer) saved under ``key`` fit ``live``, before anything loads.

    ``live`` is the strategy's ``state_dict`` of this job's model and optimizer.
    """
    where = (f"The checkpoint was written under strategy {manifest.get('strategy')!r} with "
             f"{manifest.get('num_replicas')} replica(s); this job runs {strategy_name!r}.")
    saved = _saved_shapes(manifest, shapes, key)
    own = {name: (global_shape(v) if isinstance(v, torch.Tensor) else None) for name, v in live["model"].items()}
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    mismatched = [f"{k}: checkpoint {saved[k]} vs model {own[k]}" for k in sorted(set(own) & set(saved))
                  if saved[k] is not None and own[k] is not None and saved[k] != own[k]]
    if missing or unexpected or mismatched:
        parts = [f"missing keys {missing[:5]}" if missing else "", f"unexpected keys {unexpected[:5]}" if unexpected else "",
                 f"shape mismatches {mismatched[:3]}" if mismatched else ""]
        rows = [k for k in unexpected if k.endswith(".rows")] + [k for k in missing if k.endswith(".rows")]
        wrapped = bool(unexpected) and {k.removeprefix("module.") for k in unexpected} == set(missing)
        if rows:
            fix = ("Embedding rows live on parameter-server tasks: restore it under a strategy with ps tasks ('ps' "
                   "or 'hybrid'), or under the one that wrote it.")
        elif wrapped:
            fix = ("The checkpoint holds a wrapped model's keys ('module.' prefix, e.g. DDP): save through the "
                   "strategy (save_checkpoint(..., strategy=strategy)) so the user's own module is saved.")
        else:
            fix = "Build the same model architecture (and sizes) that wrote the checkpoint."
        raise CheckpointError(f"Checkpoint {path} does not fit this model: {'; '.join(p for p in parts if p)}. "
                              f"{where} {fix}")
    if not has_optimizer:
        return
    stored = manifest["state"].get(optimizer_key) if optimizer_key else None
    in_dcp = any(p[0] == optimizer_key for p, _ in manifest["tensors"]) if optimizer_key else False
    if optimizer_key is None or (stored is None and not in_dcp):
        raise CheckpointError(
            f"Checkpoint {path} holds no optimizer state{f' under {optimizer_key!r}' if optimizer_key else ''}, but an "
            f"optimizer was given to restore: restoring only the model would restart the optimizer from zero. {where} "
            "Restore without the optimizer if that is what you want, or save it with the optimizer.")
    saved_groups = (stored or {}).get("param_groups") if isinstance(stored, Mapping) else None
    own_groups = (live.get("optimizer") or {}).get("param_groups")
    if saved_groups is not None and own_groups is not None:
        saved_names = [list(g.get("params", ())) for g in saved_groups]
        own_names = [list(g.get("params", ())) for g in own_groups]
        if saved_names != own_names:
            flat_saved = {n for g in saved_names for n in g}
            flat_own = {n for g in own_names for n in g}
            raise CheckpointError(
                f"Checkpoint {path} does not fit this optimizer: parameter groups of sizes "
                f"{[len(g) for g in saved_names]} in the file, {[len(g) for g in own_names]} here (missing "
                f"{sorted(flat_own - flat_saved)[:5]}, unexpected {sorted(flat_saved - flat_own)[:5]}). {where} "
                "Build the same optimizer (same parameter groups) that wrote it.")


def check_plain_module(path: Any, module: nn.Module, saved: Any, key: str) -> None:
    """Raise ``CheckpointError`` unless ``saved`` is a state dict that fits ``module`` (keys and shapes)."""
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"Checkpoint {path}: {key!r} holds no module state_dict (found {type(saved).__name__}).")
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    shapes = [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(own[k].shape)}" for k in sorted(set(own) & set(saved))
              if isinstance(saved[k], torch.Tensor) and tuple(saved[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        raise CheckpointError(f"Checkpoint {path}: {key!r} does not fit this module (missing keys {missing[:5]}, "
                              f"unexpected keys {unexpected[:5]}, shape mismatches {shapes[:3]}). Build the same "
                              "module that wrote it.")
