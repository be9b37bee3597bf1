"""One process on cuda: OneDeviceStrategy, mixed precision with the strategy's loss scaling, checkpoints, pinned input.

Everything here runs in the test process on cuda:0; the multi-process GPU tests are in
test_multiprocess_gpu.py. Models are linear layers only, so no TF32 convolution blurs the
comparisons with the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import gpu_jobs
import towers
from towers.cluster.info import ProcessInfo
from towers.strategies.precision import Precision

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
    pytest.mark.timeout(120),
]

CUDA0 = torch.device("cuda", 0)


def test_one_device_on_cuda_places_everything_on_the_gpu_and_matches_the_cpu():
    strategy = towers.OneDeviceStrategy(info=ProcessInfo())  # default device: cuda:0 where a GPU is visible
    assert strategy.device == CUDA0
    on_gpu = gpu_jobs.train(strategy)
    on_cpu = gpu_jobs.train(towers.OneDeviceStrategy("cpu", info=ProcessInfo()))
    assert on_gpu["batch_devices"] == ["cuda:0"] and on_cpu["batch_devices"] == ["cpu"]
    assert torch.allclose(on_gpu["losses"], on_cpu["losses"], rtol=1e-4, atol=1e-5), (on_gpu["losses"], on_cpu["losses"])
    for key, value in on_cpu["state"].items():
        assert torch.allclose(on_gpu["state"][key], value, rtol=1e-4, atol=1e-5), key


def _prepared(precision, lr: float = 0.1):
    strategy = towers.OneDeviceStrategy("/gpu:0", info=ProcessInfo(), precision=precision)
    with strategy.scope():
        net = gpu_jobs.tiny_mlp()
        optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    model, optimizer = strategy.prepare(net, optimizer)
    return strategy, net, model, optimizer


def test_bf16_autocasts_the_forward_on_cuda_and_keeps_float32_weights():
    strategy, net, model, optimizer = _prepared("bf16")
    assert strategy.precision.name == "bf16" and not strategy.precision.needs_loss_scaling
    inner: list[torch.dtype] = []
    net[0].register_forward_hook(lambda module, args, out: inner.append(out.dtype))
    x, y = (t.to(CUDA0) for t in gpu_jobs.tiny_data(32))
    reference = F.cross_entropy(net(x), y)  # the user's module itself: float32
    inner.clear()
    out = model(x)
    assert inner == [torch.bfloat16]  # the Linear ran in bf16 under autocast ...
    assert out.dtype == torch.float32  # ... and the loss is computed in float32
    loss = F.cross_entropy(out, y)
    assert abs(loss.item() - reference.item()) < 2e-2 * abs(reference.item())
    before = [p.detach().clone() for p in net.parameters()]
    strategy.backward(loss)
    optimizer.step()
    assert not optimizer.last_step_skipped
    for p, old in zip(net.parameters(), before):
        assert p.dtype == torch.float32 and p.device == CUDA0
        assert torch.isfinite(p).all() and not torch.equal(p, old)


def test_fp16_overflow_skips_the_step_lowers_the_scale_and_no_inf_reaches_the_parameters():
    precision = Precision("fp16", "cuda", init_scale=2.0**16, growth_interval=2)
    strategy, net, model, optimizer = _prepared(precision)
    assert strategy.precision is precision
    x, y = (t.to(CUDA0) for t in gpu_jobs.tiny_data(32))

    def step(factor: float) -> list[torch.Tensor]:
        before = [p.detach().clone() for p in net.parameters()]
        loss = F.cross_entropy(model(x), y) * factor
        strategy.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return before

    step(1.0)  # a normal step: applied, the scale unchanged (1 of 2 good steps)
    assert not optimizer.last_step_skipped and precision.scale == 2.0**16
    before = step(1e6)  # loss x scale is far past float16's range: the fp16 gradients overflow
    assert optimizer.last_step_skipped
    assert precision.scale == 2.0**15  # backed off by half
    for p, old in zip(net.parameters(), before):
        assert torch.equal(p, old), "a skipped step must leave the parameters as they were"
        assert torch.isfinite(p).all()
    assert optimizer.iterations == 1
    for _ in range(2):  # two good steps in a row: the scale grows back
        before = step(1.0)
        assert not optimizer.last_step_skipped
        assert all(torch.isfinite(p).all() and not torch.equal(p, old) for p, old in zip(net.parameters(), before))
    assert precision.scale == 2.0**16 and optimizer.iterations == 3


def test_fp16_without_strategy_backward_is_refused_on_cuda():
    strategy, net, model, optimizer = _prepared("fp16")
    x, y = (t.to(CUDA0) for t in gpu_jobs.tiny_data(8))
    F.cross_entropy(model(x), y).backward()  # forgot strategy.backward: the gradients were never scaled
    with pytest.raises(RuntimeError, match=r"strategy\.backward\(loss\)"):
        optimizer.step()


@pytest.mark.parametrize("precision", ["32", "fp16"])
def test_checkpoint_round_trip_on_cuda_resumes_exactly(tmp_path, precision):
    x, y = (t.to(CUDA0) for t in gpu_jobs.tiny_data(64))

    def build():
        strategy = towers.OneDeviceStrategy("/gpu:0", info=ProcessInfo(), precision=precision)
        with strategy.scope():
            net = gpu_jobs.tiny_mlp()
            optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
        model, optimizer = strategy.prepare(net, optimizer)
        return strategy, net, model, optimizer

    def train(strategy, model, optimizer, steps, *, overflow_first=False):
        for i in range(steps):
            loss = F.cross_entropy(model(x[i * 16:(i + 1) * 16]), y[i * 16:(i + 1) * 16])
            strategy.backward(loss * (1e6 if overflow_first and i == 0 else 1.0))
            optimizer.step()
            optimizer.zero_grad()

    strategy, net, model, optimizer = build()
    train(strategy, model, optimizer, 2, overflow_first=precision == "fp16")  # fp16: the scale is no longer the start
    scale = strategy.precision.scale
    assert precision == "32" or scale == 2.0**15
    path = strategy.save_checkpoint(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "step": 2})
    saved = {k: v.detach().clone() for k, v in net.state_dict().items()}
    train(strategy, model, optimizer, 2)
    expected = {k: v.detach().clone() for k, v in net.state_dict().items()}

    strategy2, net2, model2, optimizer2 = build()
    restored = strategy2.restore_checkpoint(path, {"model": model2, "optimizer": optimizer2})
    assert restored["step"] == 2
    assert strategy2.precision.scale == scale
    for key, value in net2.state_dict().items():
        assert value.device == CUDA0, key
        assert torch.equal(value, saved[key]), key
    moments = [s["exp_avg"] for s in optimizer2.state.values()]
    assert moments and all(m.device == CUDA0 for m in moments)
    train(strategy2, model2, optimizer2, 2)
    for key, value in net2.state_dict().items():
        assert torch.equal(value, expected[key]), f"{key}: the resumed run differs from the uninterrupted one"


def test_distributed_dataset_pins_host_batches_and_copies_them_without_blocking(monkeypatch):
    pinned: list[torch.Tensor] = []
    copies: list[tuple[bool, bool]] = []  # (source pinned, non_blocking) of each host-to-GPU copy of a batch
    pin_memory, to = torch.Tensor.pin_memory, torch.Tensor.to

    def spy_pin(self, *args, **kwargs):
        out = pin_memory(self, *args, **kwargs)
        pinned.append(out)
        return out

    def spy_to(self, *args, **kwargs):
        if self.device.type == "cpu" and any(str(a).startswith("cuda") for a in args):
            copies.append((self.is_pinned(), bool(kwargs.get("non_blocking"))))
        return to(self, *args, **kwargs)

    strategy = towers.OneDeviceStrategy("/gpu:0", info=ProcessInfo())
    x, y = gpu_jobs.tiny_data(40)
    batches = strategy.distribute_dataset((x, y), 16, shuffle=False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", spy_pin)
    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    got = [(bx, by) for bx, by in batches]
    monkeypatch.undo()
    assert [len(bx) for bx, _ in got] == [16, 16, 8]
    assert all(bx.device == CUDA0 and by.device == CUDA0 for bx, by in got)
    assert len(pinned) == 6 and all(t.is_pinned() for t in pinned)  # x and y of each of 3 batches
    assert copies == [(True, True)] * 6
    torch.cuda.synchronize()
    assert torch.equal(torch.cat([bx for bx, _ in got]).cpu(), x)  # what arrived is what was sent
    assert torch.equal(torch.cat([by for _, by in got]).cpu(), y)



def test_counting_the_labels_of_a_batch_on_the_gpu_does_not_wait_for_the_gpu():
    from towers.data._batch import to_device
    from towers.training.batches import label_count, split

    idx = torch.randint(0, 10, (4, 6))
    targets = idx.clone()
    targets[1] = -1
    parts = split(to_device((idx, targets), CUDA0), with_labels_in_inputs=True)
    torch.cuda.set_sync_debug_mode("error")  # any host-device synchronisation raises
    try:
        assert label_count(parts, -1) == 18
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert parts.labels.device == CUDA0


@pytest.mark.parametrize("loss", ["own token mean", "cross entropy"])
def test_a_trainer_step_on_the_gpu_between_metric_reductions_never_waits_for_the_gpu(loss):
    # Waiting for the device at every step (a label count, a weight read back, metrics reduced every step)
    # cost the 69.5M GPT 15-20% of its examples/s on an H100. Between the reductions of log_every_n_steps, a
    # step must queue its work and return: any host-device synchronisation inside it raises here.
    from towers.models_gpt import GPT, GPTConfig, random_tokens

    strategy = towers.OneDeviceStrategy("/gpu:0", info=ProcessInfo())
    config = GPTConfig.tiny()
    data = random_tokens(64, config) if loss == "own token mean" else gpu_jobs.tiny_data(64)
    with strategy.scope():
        net, loss_fn = (GPT(config), None) if loss == "own token mean" else (gpu_jobs.tiny_mlp(), F.cross_entropy)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    trainer = towers.Trainer(net, optimizer, loss_fn, strategy=strategy, log_every_n_steps=100)
    checked: list[int] = []

    class NoWaitInside(towers.callbacks.Callback):  # steps 1..6 of 8: no reduction falls on them
        def on_train_batch_begin(self, batch, logs=None):
            if 1 <= batch <= 6:
                torch.cuda.set_sync_debug_mode("error")
                checked.append(batch)

        def on_train_batch_end(self, batch, logs=None):
            torch.cuda.set_sync_debug_mode(0)

    try:
        history = trainer.fit(data, epochs=1, global_batch_size=8, callbacks=[NoWaitInside()])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert checked == [1, 2, 3, 4, 5, 6] and all(map(math.isfinite, history.history["loss"]))


def test_the_bundled_data_helpers_work_inside_a_gpu_scope_and_give_the_cpu_data():
    # They draw from a seeded CPU generator: inside a scope on the GPU, torch would otherwise make the tensors on
    # the GPU and refuse the CPU generator.
    from towers.datasets import synthetic_images
    from towers.models_gpt import GPTConfig, random_tokens

    outside = random_tokens(4, GPTConfig.tiny()), synthetic_images(4).tensors
    with towers.OneDeviceStrategy("/gpu:0", info=ProcessInfo()).scope():
        inside = random_tokens(4, GPTConfig.tiny()), synthetic_images(4).tensors
    for a, b in zip((*outside[0], *outside[1]), (*inside[0], *inside[1])):
        assert b.device.type == "cpu" and torch.equal(a, b)
