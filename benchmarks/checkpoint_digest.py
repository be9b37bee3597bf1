"""What the checkpoint checksums cost: saving (and restoring) the 69.5M GPT with and without them.

One process builds ``GPT(GPTConfig.small())`` (69.5M parameters, no download) with AdamW and takes
one step (834 MB of model and optimizer state), then, interleaved in each repeat (the order
alternates from one repeat to the next):

- **save with checksums**: ``towers.checkpoint.save_checkpoint`` as shipped: each file hashed
  (SHA-256) while it is written, ``checksums.json`` written last;
- **save without**: the same call with the hashing switched off (``integrity.HashingFile`` made a
  plain pass-through and DCP's plain ``FileSystemWriter`` put back: the write path before checksums);
- **restore with / without verification**: ``load_checkpoint`` of the checkpoint saved with
  checksums; with, every tensor file is hashed whole before DCP reads it (the one extra read of a
  restore), without, that check is skipped (``state.pt`` and ``.metadata``, a few KB, are checked
  in both).

Reported: the median seconds of each and the median of the per-repeat ratios (with / without).

    python benchmarks/checkpoint_digest.py                 # 5 repeats (~2 min on 2 cores)
    python benchmarks/checkpoint_digest.py --repeats 3 --json digest.json

The checkpoint is written to a fresh temporary folder on the local disk (``--dir`` to choose).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from towers.checkpoint import integrity, load_checkpoint, save_checkpoint
from towers.checkpoint.layout import delete
from towers.models_gpt import GPT, GPTConfig, random_tokens


class _PlainFile(integrity.HashingFile):
    """A pass-through: writes, hashes nothing."""

    def write(self, data: Any) -> int:
        written = self.raw.write(data)
        return len(memoryview(data)) if written is None else written


@contextlib.contextmanager
def _without_checksums() -> Iterator[None]:
    from torch.distributed.checkpoint import FileSystemWriter

    saved = integrity.HashingFile, integrity.digest_writer, integrity.verify_file
    integrity.HashingFile = _PlainFile  # type: ignore[misc]
    integrity.digest_writer = lambda directory, known: FileSystemWriter(directory, sync_files=True)
    integrity.verify_file = lambda *args: None
    try:
        yield
    finally:
        integrity.HashingFile, integrity.digest_writer, integrity.verify_file = saved


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    config = GPTConfig.small()
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = random_tokens(2, config, seed=1)
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    return model, optimizer


def _hash_rate_mb_s(name: str) -> float:
    data = bytes(64 << 20)
    started = time.perf_counter()
    hashlib.new(name, data).hexdigest()
    return 64 * 1.048576 / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()

    model, optimizer = _trained()
    state_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6
    state_mb += sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor)) / 1e6
    print(f"GPT {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M + AdamW: {state_mb:.0f} MB of state; "
          f"sha256 {_hash_rate_mb_s('sha256'):.0f} MB/s, blake2b {_hash_rate_mb_s('blake2b'):.0f} MB/s on one core")
    times: dict[str, list[float]] = {k: [] for k in ("save_with", "save_without", "restore_with", "restore_without")}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "ckpt"
        state = {"model": model, "optimizer": optimizer, "step": 1}
        for repeat in range(args.repeats):
            order = ("with", "without") if repeat % 2 == 0 else ("without", "with")
            for mode in order:
                with contextlib.nullcontext() if mode == "with" else _without_checksums():
                    started = time.perf_counter()
                    save_checkpoint(path, state)
                    times[f"save_{mode}"].append(time.perf_counter() - started)
                if mode == "with":  # both restores read this checkpoint; "without" skips the tensor files' check
                    for check in order:
                        with contextlib.nullcontext() if check == "with" else _without_checksums():
                            started = time.perf_counter()
                            load_checkpoint(path)
                            times[f"restore_{check}"].append(time.perf_counter() - started)
                delete(path)
            print(f"repeat {repeat + 1}: save {times['save_with'][-1]:.2f} / {times['save_without'][-1]:.2f} s, "
                  f"restore {times['restore_with'][-1]:.2f} / {times['restore_without'][-1]:.2f} s "
                  "(with / without checksums)", flush=True)
    result: dict[str, Any] = {"state_mb": round(state_mb), "repeats": args.repeats}
    for what in ("save", "restore"):
        ratios = [a / b for a, b in zip(times[f"{what}_with"], times[f"{what}_without"])]
        result[what] = {"with_s": statistics.median(times[f"{what}_with"]),
                        "without_s": statistics.median(times[f"{what}_without"]),
                        "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]}
        r = result[what]
        print(f"{what}: with checksums {r['with_s']:.2f} s, without {r['without_s']:.2f} s, ratio {r['ratio']:.3f} "
              f"({r['ratio_range'][0]:.3f}-{r['ratio_range'][1]:.3f}), median of {args.repeats}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
