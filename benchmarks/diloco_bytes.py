"""DiLoCo against ``mode="sync"`` on the parameter servers: bytes per example, wall time and compute utilisation.

One job per setup (2 workers + 1 ps task), the same script: the seed CNN on the bundled digits,
``Trainer``-free custom loop (``strategy.run``, ``compute_average_loss``), Adam, global batch 64
(23 steps per epoch), every byte on the wire (``shared_memory=False``). Setups:

- ``sync``: a push and a reply of the whole model every step;
- ``diloco8`` / ``diloco32``: ``mode="diloco"`` with ``sync_every=8`` / ``32`` (a pass of the data ends
  a window, so 32 is the 23-step epoch here); ``diloco8_int8``: int8 changes; ``diloco8_overlap`` /
  ``diloco32_overlap``: ``overlap=True`` (an outer push's reply read after one more inner step).

Each worker reports the seconds of its training loop (wall), of its steps' forward+backward and
inner optimizer work (``compute``: the step's time minus the time a push in it waited for the ps's
reply; under sync the whole ``optimizer.step()`` is that wait; DiLoCo's outer push at a pass's end
happens outside any step and counts as waiting) and its bytes sent per example.
Compute utilisation = compute / wall: what the slow-link claim is about (the rest is waiting on the
ps task and fetching batches). The validation loss of the global model at the end is reported too.

Two places to run:

- ``--link loopback`` (default): ``towers launch --nproc-per-node 3`` on this host;
- ``--link shaped``: two network namespaces joined by a veth pair (root), the two workers on one
  "host" and the ps task on the other (TF_CONFIG), both ends of the link shaped with ``tc tbf`` to
  ``--rate-mbit`` (default 100). ``tc netem`` (the delay) is used when the kernel has it, otherwise
  the run says it shaped bandwidth only.

    python benchmarks/diloco_bytes.py                         # loopback, 3 epochs per setup (~1.5 min)
    python benchmarks/diloco_bytes.py --link shaped --epochs 2
    python benchmarks/diloco_bytes.py --link shaped --epochs 2 --model gpt   # the char GPT of diloco_gpt.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETUPS = {
    "sync": {"mode": "sync"},
    "diloco8": {"mode": "diloco", "sync_every": 8},
    "diloco32": {"mode": "diloco", "sync_every": 32},
    "diloco8_int8": {"mode": "diloco", "sync_every": 8, "compression": "int8"},
    "diloco8_overlap": {"mode": "diloco", "sync_every": 8, "overlap": True},
    "diloco32_overlap": {"mode": "diloco", "sync_every": 32, "overlap": True},
}
PORT = 29731


def _job(options: dict, epochs: int) -> None:
    """Inside the launched job: train; each worker prints one ``RESULT {json}`` line."""
    import torch
    import torch.nn.functional as F

    import towers
    from towers.datasets import load_digits
    from towers.models import SeedCNN

    options = dict(options)
    gpt = options.pop("model") == "gpt"
    strategy = towers.ParameterServerStrategy(timeout_s=300, shared_memory=False, **options)
    torch.manual_seed(0)
    if gpt:  # benchmarks/diloco_gpt.py's model and text
        from diloco_gpt import BLOCK, _windows

        from towers.models_gpt import GPT, GPTConfig

        vocab, (x_train, y_train), test = _windows()
        train_set, batch = torch.utils.data.TensorDataset(x_train, y_train), 32
        with strategy.scope():
            model = GPT(GPTConfig(vocab_size=vocab, block_size=BLOCK, n_layer=2, n_head=4, n_embd=128))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        train_set, test_data = load_digits()
        test, batch = test_data.tensors, 64
        with strategy.scope():
            model = SeedCNN()
            optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    model, optimizer = strategy.prepare(model, optimizer)
    batches = strategy.distribute_dataset(train_set, batch, seed=0)
    waits = {"push": 0.0, "compute": 0.0}

    def per_example(out, y):
        if not gpt:
            return F.cross_entropy(out, y, reduction="none")
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(len(y), -1).mean(1)

    def step(x, y):
        began = time.perf_counter()
        loss = towers.compute_average_loss(per_example(model(x), y))
        loss.backward()
        before, outer_before = time.perf_counter(), strategy.wire_stats().get("outer_wait_s", 0.0)
        optimizer.step()
        optimizer.zero_grad()
        done = time.perf_counter()
        if options["mode"] == "sync":  # the whole step() is a push and its reply
            waits["push"] += done - before
        else:  # the outer pushes this step made (those at a pass's end happen outside any step)
            waits["push"] += strategy.wire_stats()["outer_wait_s"] - outer_before
        waits["compute"] += done - began
        return loss

    began = time.perf_counter()
    for epoch in range(epochs):
        batches.set_epoch(epoch)
        for x, y in batches:
            strategy.run(step, args=(x, y))
    wall = time.perf_counter() - began
    stats = strategy.wire_stats()
    push = waits["push"]
    x_test, y_test = test
    with torch.no_grad():
        val = per_example(strategy.unwrap(model)(x_test.to(strategy.device)), y_test.to(strategy.device)).mean().item()
    examples = epochs * len(train_set) / strategy.num_replicas_in_sync
    print("RESULT " + json.dumps({"worker": strategy.replica_id, "wall_s": wall, "compute_s": waits["compute"] - push,
                                  "push_s": push, "outer_wait_s": stats.get("outer_wait_s", 0.0),
                                  "bytes_sent": stats["bytes_sent"], "bytes_per_example": stats["bytes_sent"] / examples,
                                  "val_loss": val}), flush=True)
    strategy.shutdown()


def _results(out: str) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line]


def _loopback(script: Path, options: dict, epochs: int) -> list[dict]:
    towers = Path(sys.executable).with_name("towers")
    cmd = [str(towers), "launch", "--strategy", "ps", "--num-ps", "1", "--nproc-per-node", "3",
           str(script), json.dumps(options), str(epochs)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"job failed: {' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return _results(done.stdout)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


def _shaped_link(rate_mbit: int, delay_ms: float) -> tuple[list[str], list[str], str]:
    """Make two namespaces and a shaped veth pair; return (namespaces, interfaces, what was shaped)."""
    tag = str(os.getpid() % 100000)
    ns, veth, addr = [f"twdl{tag}{s}" for s in "ab"], [f"twd{tag}{s}" for s in "ab"], ["10.78.0.1", "10.78.0.2"]
    for n in ns:
        _ip("netns", "add", n)
    _ip("link", "add", veth[0], "netns", ns[0], "type", "veth", "peer", "name", veth[1], "netns", ns[1])
    shaped = f"tbf {rate_mbit} Mbit/s each way"
    for i in range(2):
        _ip("-n", ns[i], "link", "set", "lo", "up")
        _ip("-n", ns[i], "addr", "add", f"{addr[i]}/24", "dev", veth[i])
        _ip("-n", ns[i], "link", "set", veth[i], "up")
        netem = subprocess.run(["ip", "netns", "exec", ns[i], "tc", "qdisc", "add", "dev", veth[i], "root", "netem",
                                "delay", f"{delay_ms / 2:g}ms", "rate", f"{rate_mbit}mbit"], capture_output=True, text=True)
        if netem.returncode == 0:
            shaped = f"netem {rate_mbit} Mbit/s, {delay_ms:g} ms round trip"
            continue
        subprocess.run(["ip", "netns", "exec", ns[i], "tc", "qdisc", "add", "dev", veth[i], "root", "tbf", "rate",
                        f"{rate_mbit}mbit", "burst", "64kb", "latency", "400ms"], check=True, capture_output=True)
        shaped = f"tbf {rate_mbit} Mbit/s each way, no added delay (tc netem is not in this kernel)"
    return ns, veth, shaped


def _shaped(script: Path, options: dict, epochs: int, ns: list[str], veth: list[str]) -> list[dict]:
    cluster = {"chief": [f"10.78.0.1:{PORT}"], "worker": [f"10.78.0.1:{PORT + 1}"], "ps": [f"10.78.0.2:{PORT + 2}"]}
    roles = [(0, "chief", 0), (0, "worker", 0), (1, "ps", 0)]
    procs = []
    for host, kind, index in roles:
        env = {**os.environ, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}}),
               "GLOO_SOCKET_IFNAME": veth[host], "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns[host], sys.executable, str(script),
                                       json.dumps(options), str(epochs)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"job failed ({p.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
    return _results("".join(out for out, _ in outs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", choices=("loopback", "shaped"), default="loopback")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--setups", default="sync,diloco8,diloco32,diloco8_int8")
    parser.add_argument("--model", choices=("cnn", "gpt"), default="cnn",
                        help="gpt: benchmarks/diloco_gpt.py's char-level GPT (~0.4M parameters), global batch 32")
    parser.add_argument("--rate-mbit", type=int, default=100)
    parser.add_argument("--delay-ms", type=float, default=50.0, help="round trip, where tc netem is available")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    names = args.setups.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "diloco_job.py"
        script.write_text(f"import json, sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                          "from diloco_bytes import _job\n_job(json.loads(sys.argv[1]), int(sys.argv[2]))\n")
        ns: list[str] = []
        try:
            if args.link == "shaped":
                ns, veth, shaped = _shaped_link(args.rate_mbit, args.delay_ms)
                print(f"link: {shaped}; 2 workers on one namespace, the ps task on the other")
            rows = {}
            for name in names:
                began = time.perf_counter()
                options = {**SETUPS[name], "model": args.model}
                runs = (_shaped(script, options, args.epochs, ns, veth) if args.link == "shaped"
                        else _loopback(script, options, args.epochs))
                rows[name] = {"workers": runs, "job_s": time.perf_counter() - began}
                mean = {k: sum(r[k] for r in runs) / len(runs) for k in ("wall_s", "compute_s", "bytes_per_example")}
                print(f"{name:>14}: loop {mean['wall_s']:6.1f} s, compute utilisation "
                      f"{mean['compute_s'] / mean['wall_s']:.3f}, {mean['bytes_per_example']:8.0f} bytes sent per "
                      f"example, val loss {runs[0]['val_loss']:.4f}", flush=True)
        finally:
            for n in ns:
                subprocess.run(["ip", "netns", "delete", n], capture_output=True, timeout=20)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
