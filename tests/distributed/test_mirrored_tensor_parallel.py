"""MirroredStrategy with a tensor-parallel mesh keeps one device's maths: the same script at 4 processes and at 1.

One spawn of 4 processes under ``MirroredStrategy(mesh="dp=2,tp=2")`` (what ``towers launch --strategy
mirrored --mesh dp=2,tp=2`` builds): each model replica is 2 processes that split every block of towers'
GPT (attention heads and MLP units) and see the same batch; DDP sums each slice's gradient over the 2
replicas. The reference is the plain torch loop a user writes on one device (no towers): the custom
loop (``compute_average_loss``, SGD with momentum, a global-norm clip through ``strategy.clip_grad_norm_``).
The checkpoint the job writes holds whole tensors: it loads into a plain one-process model, and back
into the job's slices. torch's own ``clip_grad_norm_`` on the prepared parameters (the slices a process
holds) is refused at the step, on every process, naming ``strategy.clip_grad_norm_``.
"""

from __future__ import annotations

import pytest
import torch

import towers
from gpt_support import token_loss
from towers.models_gpt import GPT, GPTConfig, random_tokens

pytestmark = pytest.mark.timeout(300)

CONFIG = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)  # as test_tensor_parallel.py
GBS, STEPS, CLIP = 8, 3, 0.5
RTOL, ATOL = 1e-4, 1e-5  # rounding: TP sums each row-split layer's partial outputs in another order


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    return random_tokens(GBS * STEPS, CONFIG, seed=1)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _job(checkpoint_dir: str) -> dict:
    from torch.distributed.tensor import DTensor

    strategy = towers.MirroredStrategy(mesh="dp=2,tp=2")
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    norms, batches = [], []
    for xb, yb in strategy.distribute_dataset(_data(), global_batch_size=GBS, shuffle=False):
        def step(xb, yb):
            strategy.backward(towers.compute_average_loss(token_loss(model(xb), yb)))
            norms.append(float(strategy.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
        batches.append(xb[:, 0].tolist())
        strategy.run(step, args=(xb, yb))
    state = strategy.full_state_dict(model)
    towers.checkpoint.save_checkpoint(checkpoint_dir, {"model": model, "optimizer": optimizer}, strategy=strategy)

    with strategy.scope():  # the checkpoint back into the slices of a fresh model
        again = _model()
        again_optimizer = torch.optim.SGD(again.parameters(), lr=0.5, momentum=0.9)
    again, again_optimizer = strategy.prepare(again, again_optimizer)
    towers.checkpoint.restore_checkpoint(checkpoint_dir, {"model": again, "optimizer": again_optimizer},
                                         strategy=strategy)
    restored = strategy.state_dict(again, again_optimizer)

    torch_clip = None  # torch's own clip on the slices this process holds: refused at the step, on every process
    for xb, yb in strategy.distribute_dataset(_data(), global_batch_size=GBS, shuffle=False):
        def clipped_by_torch(xb, yb):
            towers.compute_average_loss(token_loss(again(xb), yb)).backward()
            torch.nn.utils.clip_grad_norm_(again.parameters(), CLIP)
            again_optimizer.step()
        try:
            strategy.run(clipped_by_torch, args=(xb, yb))
        except ValueError as exc:
            torch_clip = str(exc)
        break

    qkv = strategy.unwrap(model).blocks[0].attn.qkv.weight
    facts = {"replicas": strategy.num_replicas_in_sync, "replica": strategy.replica_id, "chief": strategy.is_chief,
             "tp": strategy.tensor_parallel_size, "mesh": tuple(strategy.mesh.mesh_dim_names),
             "qkv": (type(qkv).__name__, tuple(type(p).__name__ for p in qkv.placements) if isinstance(qkv, DTensor) else None,
                     tuple(qkv.to_local().shape) if isinstance(qkv, DTensor) else None, tuple(qkv.shape)),
             "batches": batches}
    return {"state": state, "norms": norms, "facts": facts, "restored": restored["model"], "torch_clip": torch_clip,
            "momentum": restored["optimizer"]["state"]}


def _plain_loop() -> tuple[dict, list[float], dict]:
    """The custom loop on one device without towers; also returns the momentum buffers by parameter name."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    x, y = _data()
    norms = []
    for i in range(STEPS):
        xb, yb = x[i * GBS:(i + 1) * GBS], y[i * GBS:(i + 1) * GBS]
        token_loss(model(xb), yb).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    momentum = {n: optimizer.state[p]["momentum_buffer"] for n, p in model.named_parameters()}
    return model.state_dict(), norms, momentum


def _max_diff(got: dict, want: dict) -> float:
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want)


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[list[dict], object]:
    checkpoint_dir = tmp_path_factory.mktemp("mirrored_tp") / "ckpt"
    return towers.spawn(_job, 4, args=(str(checkpoint_dir),), timeout_s=240), checkpoint_dir


def test_dp2_tp2_under_mirrored_trains_as_one_device(launch):
    results, _ = launch
    facts = [r["facts"] for r in results]
    assert [f["chief"] for f in facts] == [True, False, False, False]  # the job's chief, not each tp process of replica 0
    assert {f["replicas"] for f in facts} == {2} and {f["tp"] for f in facts} == {2}
    assert [f["replica"] for f in facts] == [0, 0, 1, 1]
    assert {f["mesh"] for f in facts} == {("dp_replicate", "dp_shard", "tp")}
    # the qkv projection is split by output over tp: each process holds half of its rows, read as a DTensor
    assert {f["qkv"] for f in facts} == {("DTensor", ("Shard",), (48, 32), (96, 32))}
    # the tp processes of one replica see the same batch; the two replicas split the global batch
    assert facts[0]["batches"] == facts[1]["batches"] and facts[2]["batches"] == facts[3]["batches"]
    assert facts[0]["batches"] != facts[2]["batches"]

    reference, norms, momentum = _plain_loop()
    assert min(norms) > CLIP  # every update was clipped: the norm decides the result
    for r in results:
        _close(r["state"], reference)
        assert r["norms"] == pytest.approx(norms, rel=1e-5)  # strategy.clip_grad_norm_: the whole model's norm
    print(f"max abs difference to the plain loop: {max(_max_diff(r['state'], reference) for r in results):.3g}")

    # the checkpoint's whole tensors, restored into a fresh prepared model, are the trained ones (momentum too)
    for r in results:
        _close(r["restored"], r["state"])
        _close({n: s["momentum_buffer"] for n, s in r["momentum"].items()}, momentum)


def test_torchs_own_clip_on_the_slices_is_refused_at_the_step_on_every_process(launch):
    results, _ = launch  # (towers' own clip in the main loop passed the same check at every update)
    for r in results:
        assert r["torch_clip"] is not None and "each process holds its slices of the split layers" in r["torch_clip"]
        assert "Clip with strategy.clip_grad_norm_(model.parameters(), max_norm) instead" in r["torch_clip"]


def test_its_checkpoint_holds_whole_tensors_and_loads_on_one_process(launch):
    results, checkpoint_dir = launch
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    towers.checkpoint.restore_checkpoint(checkpoint_dir, {"model": model, "optimizer": optimizer})
    _close(model.state_dict(), results[0]["state"])
    _, _, momentum = _plain_loop()
    _close({n: optimizer.state[p]["momentum_buffer"] for n, p in model.named_parameters()}, momentum)
