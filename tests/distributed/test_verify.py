"""``towers verify`` on real scripts, written here into tmp_path: it runs them as one process and under strategies.

- A correct towers script passes under mirrored and sharded (the real command, in a new session, nothing left
  behind), and a script whose loss is divided by the per-replica batch fails with the cause named.
- Each seeded fault of the catalogue, one script with a switch, is named: a refused per-replica mean loss, the
  original module called in the step, no seed before building the model, every replica reading the whole batch,
  a clip in a gradient hook (before the replicas sum), unsynchronised BatchNorm.
- Code nobody here wrote: a Hugging Face GPT-2 (from a config, dropout on as configs come) in a custom loop; a
  nanoGPT-style plain DDP script (gradient accumulation, flash attention dropout, weight tying, torch's clip); a plain
  DDP script with a DistributedSampler and an uneven last batch, and the same script bypassing DDP.
- Data that is not one process's: the plain DDP script without its DistributedSampler (every replica reads the same
  examples), and nanoGPT's own get_batch (each rank draws random batches from its own seed, by design).

The expected verdict is what the plain torch maths says: a correct script gives one process's parameters.
"""

from __future__ import annotations

import pytest

from cli_support import run, towers_command
from towers.verify import VerifySpec, verify

pytestmark = pytest.mark.timeout(300)

FAULTS = r'''import sys
import torch
import torch.nn.functional as F
from torch import nn
import towers

fault = sys.argv[1] if len(sys.argv) > 1 else "none"
strategy = towers.strategy_from_env()
if fault != "unseeded":
    torch.manual_seed(0)
layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)]
if fault == "batchnorm":
    layers.insert(1, nn.BatchNorm1d(16))
with strategy.scope():
    model = nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
raw = model
if fault == "clip_hook":
    for p in model.parameters():
        p.register_hook(lambda g: g.clamp(-0.01, 0.01))
model, optimizer = strategy.prepare(model, optimizer)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
B = 32

def batches():
    if fault == "whole_batch":
        for i in range(0, len(x), B):
            yield x[i:i + B], y[i:i + B]
    else:
        yield from strategy.distribute_dataset((x, y), global_batch_size=B)

def step(xb, yb):
    out = (raw if fault == "not_prepared" else model)(xb)
    if fault == "mean_loss":
        loss = F.cross_entropy(out, yb)
    else:
        per = F.cross_entropy(out, yb, reduction="none")
        n = xb.shape[0] if fault == "local_mean" else B if fault == "whole_batch" else None
        loss = towers.compute_average_loss(per, global_batch_size=n)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

for epoch in range(3):
    for xb, yb in batches():
        strategy.run(step, args=(xb, yb))
'''

PLAIN_DDP = r'''import argparse, os
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--examples", type=int, default=32)
parser.add_argument("--bypass-ddp", action="store_true")
parser.add_argument("--no-sampler", action="store_true")  # every rank iterates the whole data set
args = parser.parse_args()
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
if world > 1:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(args.examples, 8, generator=g), torch.randint(0, 3, (args.examples,), generator=g))
sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False) if world > 1 and not args.no_sampler else None
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
ddp = DDP(model) if world > 1 else model
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
for epoch in range(2):
    for x, y in loader:
        out = model(x) if args.bypass_ddp else ddp(x)
        F.cross_entropy(out, y).backward()
        optimizer.step()
        optimizer.zero_grad()
if world > 1:
    dist.destroy_process_group()
'''

NANOGPT = r'''import math, os, sys
import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.distributed import init_process_group, destroy_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

block_size, vocab_size, n_layer, n_head, n_embd, dropout = 16, 64, 2, 2, 32, 0.1
batch_size, gradient_accumulation_steps, max_iters = 4, 4, 20
random_batches = "--random-batches" in sys.argv  # nanoGPT's own get_batch: each rank draws from its own seed

class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)
    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=dropout if self.training else 0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(n_embd), CausalSelfAttention(), nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))
    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
                                              drop=nn.Dropout(dropout), h=nn.ModuleList([Block() for _ in range(n_layer)]),
                                              ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    init_process_group(backend='gloo')
    ddp_rank, ddp_world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    master_process = ddp_rank == 0
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    ddp_rank, ddp_world_size, master_process = 0, 1, True
torch.manual_seed(1337 + (ddp_rank if random_batches else 0))  # nanoGPT: seed_offset = ddp_rank
data = torch.randint(0, vocab_size, (4096,), generator=torch.Generator().manual_seed(0))

def get_batch(it, micro_step):
    if random_batches:
        ix = torch.randint(len(data) - block_size, (batch_size,))
        return (torch.stack([data[i:i + block_size] for i in ix]), torch.stack([data[i + 1:i + 1 + block_size] for i in ix]))
    # deterministic: update `it` covers micro-batches it*total .. +total; this rank takes its contiguous share
    total = gradient_accumulation_steps * ddp_world_size
    start = (it * total + ddp_rank * gradient_accumulation_steps + micro_step) * batch_size * block_size
    ix = torch.arange(batch_size) * block_size + start
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y

model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
if ddp:
    model = DDP(model)
for it in range(max_iters):
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        X, Y = get_batch(it, micro_step)
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
if ddp:
    destroy_process_group()
'''

HF_LOOP = r'''import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel
import towers

strategy = towers.strategy_from_env()
torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)  # dropout 0.1, as configs come
with strategy.scope():
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = strategy.prepare(model, optimizer)
ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))

def step(input_ids):
    logits = model(input_ids=input_ids).logits
    per_token = F.cross_entropy(logits[:, :-1].reshape(-1, 64), input_ids[:, 1:].reshape(-1), reduction="none")
    loss = towers.compute_average_loss(per_token, weights=torch.ones_like(per_token))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss

for epoch in range(2):
    for batch in strategy.distribute_dataset(ids, global_batch_size=16, seed=epoch):
        strategy.run(step, args=(batch,))
'''


def _script(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _row(tmp_path, name: str, text: str, *args: str, strategies=("mirrored",), plain: bool = False, steps: int = 3):
    report = verify(VerifySpec(script=_script(tmp_path, name, text), args=args, strategies=strategies, plain=plain,
                               steps=steps, timeout_s=120))
    assert report.reference_error is None, report.format()
    return report


def test_the_command_passes_a_correct_script_and_names_a_wrong_normalisation(tmp_path):
    script = _script(tmp_path, "train.py", FAULTS)
    ok = run([*towers_command(), "verify", "--steps", "3", script], cwd=tmp_path, deadline_s=150, marker=str(tmp_path))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    rows = [line.split() for line in ok.stdout.splitlines() if line.startswith(("mirrored", "sharded"))]
    assert [(r[0], r[1], r[2], r[-1]) for r in rows] == [("mirrored", "2", "3", "same"), ("sharded", "2", "3", "same")]
    assert "time:" in ok.stdout
    bad = run([*towers_command(), "verify", "--strategies", "mirrored", "--steps", "2", script, "--", "local_mean"],
              cwd=tmp_path, deadline_s=150, marker=str(tmp_path))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "DIFFERS" in bad.stdout and "[loss-scale]" in bad.stdout and "|update| = 2 x" in bad.stdout, bad.stdout


def test_each_seeded_fault_is_named(tmp_path):
    expected = {"mean_loss": "loss-not-global", "not_prepared": "not-prepared-model", "unseeded": "unseeded-init",
                "whole_batch": "whole-batch", "clip_hook": "clip-before-final", "batchnorm": "batchnorm-unsynced"}
    named = {}
    for fault in expected:
        row = _row(tmp_path, f"{fault}.py", FAULTS, fault).rows[0]
        named[fault] = (row.verdict, row.cause.key if row.cause else None)
    assert named == {f: ("FAILED" if f in ("mean_loss", "not_prepared") else "DIFFERS", key)
                     for f, key in expected.items()}


def test_code_nobody_here_wrote(tmp_path):
    pytest.importorskip("transformers")
    seen = {}
    hf = _row(tmp_path, "hf.py", HF_LOOP)
    seen["hf"] = [r.verdict for r in hf.rows]
    nano = _row(tmp_path, "nanogpt.py", NANOGPT, plain=True)
    seen["nanogpt"] = [r.verdict for r in nano.rows]
    batch = "{16 // world_size}"
    for name, args in {"ddp_uneven": ("--examples", "35"), "ddp_bypass": ("--examples", "32", "--bypass-ddp"),
                       "ddp_no_sampler": ("--examples", "32", "--no-sampler")}.items():
        row = _row(tmp_path, f"{name}.py", PLAIN_DDP, "--batch-size", batch, *args, plain=True).rows[0]
        seen[name] = [row.verdict, row.cause.key if row.cause else None, row.first_step]
    row = _row(tmp_path, "nanogpt_random.py", NANOGPT, "--random-batches", plain=True).rows[0]
    seen["nanogpt_random"] = [row.verdict, row.cause.key if row.cause else None, row.first_step]
    assert seen == {"hf": ["same"], "nanogpt": ["same"],  # a correct plain DDP script: nanoGPT's
                    "ddp_uneven": ["DIFFERS", "uneven-last-batch", 3], "ddp_bypass": ["DIFFERS", "replicas-drift", 1],
                    "ddp_no_sampler": ["DIFFERS", "same-examples", 1], "nanogpt_random": ["DIFFERS", "own-random-batches", 1]}
    assert "each replica draws its own random batches (by design in this script?)" in row.cause.title
