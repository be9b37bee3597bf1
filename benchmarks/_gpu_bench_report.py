"""gpu_bench.py's markdown: one table per part, the command, the machine, and what each number means."""

from __future__ import annotations

from typing import Any

ANCHOR = ("Anchor for the MFU column: torchtitan's Llama 3 8B training reaches 33-39% MFU on H100s (an 8B model's "
          "matmuls are larger than this 1B model's).")

MEANING = """## What each number means

- **tokens/s**, **examples/s**: trained per second in a timed block (S steps, the device synchronised at both ends,
  the batch iterator's start included), median over the interleaved rounds, with the range.
- **MFU**: tokens/s x model FLOPs per token / the device's peak. Model FLOPs are counted by torch's
  `FlopCounterMode` on one sequence of the plain model, forward and backward (matmuls and attention, the
  full attention square): what activation checkpointing recomputes is not counted (that would be hardware
  FLOPs). The peak is the datasheet's dense bf16 figure (`towers.diagnostics.peak`); on a CPU a measured
  float32 matmul peak.
- **/ raw**: the engine's rate over raw torch's in the same round, median over rounds. 1.00 is a hand-written
  loop's speed; part (b)'s goal is >= 0.95.
- **warm-up s**: the engine's first block, timed on its own: allocator, cuBLAS/cuDNN choices and compilation.
- **peak GiB**: `torch.cuda.max_memory_allocated` from building the model to its last timed step: weights,
  AdamW state, gradients and activations at their highest.
- **step s**: median of single timed steps after one warm-up step.
- **held before GiB**: memory still allocated when a configuration of part (c) started: about 0 when the one
  before it gave everything back (else its peak is inflated by that much).
"""


def _n(value: Any, fmt: str = ",.1f") -> str:
    return "-" if value is None else format(value, fmt)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _notes(part: dict[str, Any]) -> list[str]:
    lines = [f"- {note}" for note in part.get("notes", [])]
    if part.get("stopped"):
        lines.append(f"- stopped early: {part['stopped']}")
    lines += [f"- {name}: {error}" for name, error in (part.get("errors") or {}).items()]
    if part.get("error"):
        lines.append(f"- **the part failed**: {part['error']}")
    lines.append(f"- time: {_n(part.get('elapsed_s'), '.0f')} s of a {_n(part.get('budget_s'), '.0f')} s budget")
    return lines


def _part_a(part: dict[str, Any]) -> list[str]:
    lines = ["## (a) MFU of a GPT that fills the GPU", ""]
    c = part.get("config")
    if c:
        peak = part.get("peak_flops") or {}
        lines += [f"GPT: {c['n_layer']} layers, width {c['n_embd']}, {c['n_head']} heads, vocabulary {c['vocab_size']:,}, "
                  f"context {c['block_size']:,}; {_n(part.get('params'), ',.0f')} parameters. bf16 autocast, "
                  f"AdamW (fused on a GPU), compiled: {'yes' if part.get('compile') else 'no'}; activation checkpointing: "
                  f"{part.get('activation_checkpointing')}. Micro-batch **{part.get('batch')}** sequences "
                  f"({_n(part.get('tokens_per_step'), ',.0f')} tokens per step); probe: "
                  f"{', '.join(part.get('batch_probe') or ['not run'])}. {part.get('steps_per_block')} steps per block.",
                  "", f"Model FLOPs per token: {_n(part.get('flops_per_token'), ',.3e')}; peak: "
                  f"{peak.get('label', 'unknown for this device: no MFU')}.", ""]
    lines += ["| engine | tokens/s | range | MFU | / raw | warm-up s | rounds |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in part.get("rows", []):
        lines.append(f"| {r['engine']} | {_n(r['tokens_s'])} | {_n(r['range'][0])}-{_n(r['range'][1])} | "
                     f"{_pct(r['mfu'])} | {_n(r['vs_raw'], '.3f')} | {_n(r['warmup_s'])} | {r['rounds']} |")
    return lines + ["", ANCHOR, "", *_notes(part), ""]


def _part_b(part: dict[str, Any]) -> list[str]:
    lines = ["## (b) The Trainer at a raw loop's speed: seed CNN", "",
             f"Batch {part.get('batch')}, Adam, {part.get('steps_per_block')} steps per block; raw torch, towers' "
             "custom loop (`strategy.run`) and `Trainer.fit` (`gpu_throughput.py`'s engines), interleaved.", "",
             "| mode | engine | examples/s | range | / raw (goal >= 0.95) | warm-up s (all engines) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in part.get("rows", []):
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['engine']} | failed: {r['error']} | | | |")
            continue
        goal = "" if r["engine"] == "raw" or r["vs_raw"] is None else (" (met)" if r["vs_raw"] >= 0.95 else " (missed)")
        lines.append(f"| {r['mode']} | {r['engine']} | {_n(r['examples_s'])} | {_n(r['range'][0])}-{_n(r['range'][1])} | "
                     f"{_n(r['vs_raw'], '.3f')}{goal} | {_n(r['warmup_s'])} |")
    return lines + ["", *_notes(part), ""]


def _part_c(part: dict[str, Any]) -> list[str]:
    lines = ["## (c) Memory policies on the GPT", "",
             f"Micro-batch {part.get('batch')} (part a's), bf16, AdamW (fused on a GPU), one configuration at a time (five 1B "
             f"models with their optimizer state do not fit together); compiled: {'yes' if part.get('compile') else 'no'}.",
             "", "| configuration | status | peak GiB | step s | tokens/s | steps timed | held before GiB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in part.get("rows", []):
        status = r["status"] + (f"; {r['finding']}" if r.get("finding") else "")
        if "sharded" in r:
            status += f" (sharded: {r['sharded']}, parameters on {', '.join(r.get('params_on', []))})"
        lines.append(f"| {r['config']} | {status} | {_n(r.get('peak_gib'), '.2f')} | {_n(r.get('step_s'), '.3f')} | "
                     f"{_n(r.get('tokens_s'))} | {r.get('steps_timed', '-')} | {_n(r.get('allocated_before_gib'), '.2f')} |")
    return lines + ["", *_notes(part), ""]


def render(data: dict[str, Any]) -> str:
    """Return the markdown report of a ``gpu_bench.py`` run from its JSON record."""
    lines = [f"# GPU benchmark: {data.get('device', 'no device')}", ""]
    if data.get("skipped"):
        lines += [f"**{data['skipped']}**", ""]
    memory = f" ({data['device_memory_gib']:.1f} GiB)" if data.get("device_memory_gib") else ""
    lines += [f"- command: `{data.get('command')}`", f"- device: {data.get('device')}{memory}",
              f"- torch {data.get('torch')} (CUDA {data.get('cuda')}), Python {data.get('python')}, "
              f"{data.get('cpu_cores')} CPU cores, PYTORCH_CUDA_ALLOC_CONF={data.get('alloc_conf')}",
              f"- started {data.get('started')}; budget {_n(data.get('budget_s'), '.0f')} s; "
              f"took {_n(data.get('elapsed_s'), '.0f')} s"]
    if data.get("tiny"):
        lines.append("- **smoke sizes** (`--tiny`): these numbers say that the code runs, not how fast anything is")
    if data.get("stopped"):
        lines.append(f"- **{data['stopped']}**")
    lines.append("")
    parts = data.get("parts", {})
    for name, render_part in (("a", _part_a), ("b", _part_b), ("c", _part_c)):
        if name in parts:
            lines += render_part(parts[name])
    if parts:
        lines.append(MEANING)
    return "\n".join(lines).rstrip() + "\n"
