"""Tensor parallelism on a (dp, tp) mesh keeps one device's maths: the same script at 4 processes and at 1.

One spawn of 4 processes under ``FullyShardedStrategy(mesh="dp=2,tp=2")`` (what ``towers launch
--strategy sharded --mesh dp=2,tp=2`` builds): each model replica is 2 processes that split every
block of towers' GPT (attention heads and MLP units) and see the same batch; FSDP2 shards each split
layer over the 2 replicas. The references are the plain torch loops a user writes on one device
(no towers): the README-style custom loop (``compute_average_loss``, SGD with momentum, torch's own
``clip_grad_norm_`` on the prepared parameters) and ``Trainer.fit`` on the model's own loss. The
sharded checkpoint the job writes loads into a plain one-process model and into another mesh (tp=4).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import towers
from towers.models_gpt import GPT, GPTConfig, random_tokens

pytestmark = pytest.mark.timeout(300)

CONFIG = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)
GBS, STEPS, CLIP = 8, 3, 0.5
RTOL, ATOL = 1e-4, 1e-5  # rounding: TP sums each row-split layer's partial outputs in another order


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    return random_tokens(GBS * STEPS, CONFIG, seed=1)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean token loss (one value per example)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(len(y), -1).mean(1)


def _job(checkpoint_dir: str) -> dict:
    strategy = towers.FullyShardedStrategy(mesh="dp=2,tp=2")
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    x, y = _data()
    norms = []
    for xb, yb in strategy.distribute_dataset((x, y), global_batch_size=GBS, shuffle=False):
        def step(xb, yb):
            strategy.backward(towers.compute_average_loss(_token_loss(model(xb), yb)))
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).full_tensor()))
            optimizer.step()
            optimizer.zero_grad()
        strategy.run(step, args=(xb, yb))
    loop = strategy.full_state_dict(model)
    towers.checkpoint.save_checkpoint(checkpoint_dir, {"model": model, "optimizer": optimizer}, strategy=strategy)

    with strategy.scope():
        net = _model()
        trainer = towers.Trainer(net, torch.optim.SGD(net.parameters(), lr=0.5), ignore_index=-1, strategy=strategy,
                                 breakdown_every=0)
    history = trainer.fit((x, y), epochs=1, global_batch_size=GBS, shuffle=False)
    fit = strategy.full_state_dict(trainer.model)
    split = strategy.unwrap(model).blocks[0].attn.qkv.weight
    whole = strategy.unwrap(model).wte.weight
    facts = {"replicas": strategy.num_replicas_in_sync, "mesh": tuple(strategy.mesh.mesh_dim_names),
             "shape": tuple(strategy.mesh.shape), "placements": [[type(p).__name__ for p in w.placements] for w in (split, whole)],
             "tp": strategy.tensor_parallel_size, "chief": strategy.is_chief, "loss": history["loss"]}
    return {"loop": loop, "fit": fit, "norms": norms, "facts": facts}


def _restore_under(mesh: str, checkpoint_dir: str) -> dict:
    strategy = towers.FullyShardedStrategy(mesh=mesh)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    towers.checkpoint.restore_checkpoint(checkpoint_dir, {"model": model, "optimizer": optimizer}, strategy=strategy)
    return strategy.full_state_dict(model)


def _plain_loop() -> tuple[dict, list[float]]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    x, y = _data()
    norms = []
    for i in range(STEPS):
        xb, yb = x[i * GBS:(i + 1) * GBS], y[i * GBS:(i + 1) * GBS]
        _token_loss(model(xb), yb).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), norms


def _plain_fit() -> tuple[dict, float]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _data()
    losses = []
    for i in range(STEPS):
        _, loss = model(x[i * GBS:(i + 1) * GBS], y[i * GBS:(i + 1) * GBS])  # nanoGPT's own mean token loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), sum(losses) / len(losses)


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")


def test_dp2_tp2_trains_as_one_device_and_its_checkpoint_loads_on_one_process(tmp_path):
    results = towers.spawn(_job, 4, args=(str(tmp_path / "ckpt"),), timeout_s=240)
    chief = results[0]
    facts = [r["facts"] for r in results]
    assert [f["chief"] for f in facts] == [True, False, False, False]
    assert {(f["replicas"], f["mesh"], f["shape"], f["tp"]) for f in facts} == {(2, ("dp", "tp"), (2, 2), 2)}
    # a split layer is sharded over dp (FSDP2) and tp; the embedding over dp, replicated on the tp processes
    assert facts[0]["placements"] == [["_StridedShard", "Shard"], ["Shard", "Replicate"]]  # FSDP2 over TP's shard
    assert all(f["loss"] == facts[0]["loss"] for f in facts)  # every process reports the job's History

    reference, norms = _plain_loop()
    _close(chief["loop"], reference)
    assert chief["norms"] == pytest.approx(norms, rel=1e-5)  # torch's own clip_grad_norm_: the whole model's norm

    fit_reference, mean_loss = _plain_fit()
    _close(chief["fit"], fit_reference)
    assert facts[0]["loss"][0] == pytest.approx(mean_loss, rel=1e-5)

    model = _model()  # one process, no strategy: the tensor-parallel shards reassemble into the full tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    towers.checkpoint.restore_checkpoint(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    _close(model.state_dict(), reference)
    assert all(len(s["momentum_buffer"].shape) > 0 for s in optimizer.state.values())

    # and into another mesh: one replica split 4 ways
    resharded = towers.spawn(_restore_under, 4, args=("tp=4", str(tmp_path / "ckpt")), timeout_s=240)[0]
    _close(resharded, reference)
