"""OneDeviceStrategy: the reference strategy — API, accumulation maths, reductions and clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster.info import ProcessInfo
from towers.cluster.launch_notes import strategies_built
from towers.strategies import get_strategy, strategy_from_env
from towers.strategies.one_device import OneDeviceStrategy


def _strategy(**kw) -> OneDeviceStrategy:
    return OneDeviceStrategy("cpu", info=ProcessInfo(), **kw)


def _data(n=22):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def _train(strategy, gbs, *, epochs=2, zero_first=False):
    torch.manual_seed(0)
    with strategy.scope():
        net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.3, momentum=0.9)
    model, opt = strategy.prepare(net, opt)
    batches = strategy.distribute_dataset(_data(), gbs, shuffle=True, seed=4)

    def step(x, y):
        if zero_first:
            opt.zero_grad()
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        opt.step()
        if not zero_first:
            opt.zero_grad()
        return loss

    losses = []
    for _ in range(epochs):
        losses.append([strategy.reduce("sum", strategy.run(step, args=batch)).item() for batch in batches])
    return [p.detach().clone() for p in net.parameters()], losses


def test_built_by_name_and_from_a_single_process_environment():
    assert isinstance(get_strategy("one_device", info=ProcessInfo()), OneDeviceStrategy)
    strategy = strategy_from_env(ProcessInfo())
    assert isinstance(strategy, OneDeviceStrategy)
    assert (strategy.num_replicas_in_sync, strategy.replica_id, strategy.is_chief) == (1, 0, True)
    assert OneDeviceStrategy("/cpu:0", info=ProcessInfo()).device == torch.device("cpu")
    assert strategy.device == torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def test_a_strategy_built_under_towers_launch_leaves_the_launcher_a_note(tmp_path):
    # towers launch --strategy names a directory in TOWERS_LAUNCH_DIR; it warns at the end when no note is there.
    info = towers.cluster.from_env({"TOWERS_LAUNCH_DIR": str(tmp_path)})
    assert info.launch_dir == str(tmp_path) and strategies_built(str(tmp_path)) == {}
    OneDeviceStrategy("cpu", info=info)
    assert strategies_built(str(tmp_path)) == {0: "one_device"}
    assert towers.cluster.from_env({}).launch_dir is None  # outside towers launch: nowhere to write


def test_scope_places_new_tensors_on_the_device():
    strategy = _strategy()
    with strategy.scope():
        assert towers.current_strategy() is strategy
        assert torch.zeros(1).device == strategy.device
    assert towers.current_strategy() is None


def test_the_whole_global_batch_arrives_in_one_piece():
    strategy = _strategy()
    sizes = [len(x) for x, _ in strategy.distribute_dataset(_data(), 8)]
    assert sizes == [8, 8, 6]


def test_accumulating_micro_batches_is_one_update_of_their_union():
    reference, ref_losses = _train(_strategy(), 8)
    for zero_first in (False, True):
        params, _ = _train(_strategy(gradient_accumulation_steps=2), 4, zero_first=zero_first)
        for p, q in zip(params, reference):
            assert torch.allclose(p, q, atol=1e-6)
    assert len(ref_losses[0]) == 3


def test_the_optimizer_steps_only_on_the_last_micro_batch():
    strategy = _strategy(gradient_accumulation_steps=3)
    net = nn.Linear(1, 1)
    model, opt = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    flags = [strategy.run(lambda b: opt.is_update_step, args=(b,)) for b in strategy.distribute_dataset(torch.ones(10), 2)]
    assert flags == [False, False, True, False, True]  # 5 batches: an update of 3, then the epoch's last 2
    # Without distribute_dataset batches, every third run updates.
    assert [strategy.run(lambda: opt.is_update_step) for _ in range(6)] == [False, False, True] * 2


def test_reductions():
    strategy = _strategy()
    v = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    assert torch.equal(strategy.reduce("sum", v), v)
    assert torch.equal(strategy.reduce("mean", v, axis=0), torch.tensor([2.0, 4.0]))
    assert torch.equal(strategy.reduce("max", v, axis=1), torch.tensor([2.0, 6.0]))
    assert torch.equal(strategy.reduce("min", v, axis=-1), torch.tensor([1.0, 3.0]))
    assert strategy.reduce("sum", 3).item() == 3
    assert torch.equal(strategy.gather(v), v)
    strategy.barrier()
    assert strategy.broadcast_object({"a": 1}) == {"a": 1} and strategy.all_gather_object(5) == [5]


def test_bad_reduce_arguments_are_explained():
    strategy = _strategy()
    with pytest.raises(ValueError, match="reduce op must be one of.*Received: 'avg'"):
        strategy.reduce("avg", torch.ones(2))
    with pytest.raises(ValueError, match="axis must be None or a dimension"):
        strategy.reduce("sum", torch.ones(2), axis=3)
    with pytest.raises(TypeError, match="tensor or a number"):
        strategy.reduce("sum", "loss")


def test_run_before_prepare_is_explained():
    with pytest.raises(RuntimeError, match="before any model was prepared"):
        _strategy().run(lambda: None)


def test_preparing_twice_is_explained():
    strategy = _strategy(precision="bf16")
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, wrapped_opt = strategy.prepare(net, opt)
    with pytest.raises(ValueError, match="already prepared"):
        strategy.prepare(net)
    with pytest.raises(ValueError, match="already prepared"):
        strategy.prepare(model)
    with pytest.raises(ValueError, match="optimizer was already prepared"):
        strategy.prepare(nn.Linear(2, 2), wrapped_opt)
    with pytest.raises(TypeError, match="nn.Module"):
        strategy.prepare(lambda x: x)


def test_options_for_many_devices_are_accepted_and_bad_ones_rejected():
    _strategy(sync_batchnorm=True, gradient_compression="fp16", bucket_cap_mb=10)
    with pytest.raises(ValueError, match="gradient_compression must be one of"):
        _strategy(gradient_compression="zip")
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be a positive integer"):
        _strategy(gradient_accumulation_steps=0)


def test_bf16_trains():
    params, losses = _train(_strategy(precision="bf16"), 8, epochs=3)
    assert losses[-1][0] < losses[0][0]


def test_the_optimizer_wrapper_works_with_lr_schedulers_and_state_dicts():
    strategy = _strategy()
    net = nn.Linear(2, 1)
    _, opt = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.5


def test_mirrored_with_one_process_needs_no_process_group_and_matches_one_device():
    from towers.process_group import is_initialized
    from towers.strategies.mirrored import MirroredStrategy

    mirrored = MirroredStrategy(info=ProcessInfo(), sync_batchnorm=True, gradient_compression="powersgd")
    assert not is_initialized() and mirrored.num_replicas_in_sync == 1 and mirrored.is_chief
    params, losses = _train(mirrored, 8)
    reference, ref_losses = _train(_strategy(), 8)
    assert losses == ref_losses and all(torch.equal(p, q) for p, q in zip(params, reference))
    mirrored.barrier()
    mirrored.shutdown()


def test_strategies_check_for_idle_gpus_at_construction(monkeypatch):
    import towers.devices
    from towers.strategies.mirrored import MirroredStrategy

    calls = []
    monkeypatch.setattr(towers.devices, "warn_if_gpus_idle",
                        lambda n, used, *, local_rank=0: calls.append((n, [str(d) for d in used], local_rank)))
    OneDeviceStrategy("cpu", info=ProcessInfo())
    MirroredStrategy(info=ProcessInfo())
    assert calls == [(1, ["cpu"], 0), (1, ["cpu"], 0)]


def test_a_second_strategys_loop_without_run_is_not_steered_by_the_first_ones_last_step():
    """A script (or a notebook) that trains with one strategy and then another, each in a loop without
    ``strategy.run``: the second strategy's batches must set the step, not the first strategy's last batch."""
    x, y = torch.randn(16, 3), torch.randn(16, 1)
    first = OneDeviceStrategy("cpu", gradient_accumulation_steps=2)
    model, _ = first.prepare(nn.Linear(3, 1))
    for xb, yb in first.distribute_dataset((x, y), global_batch_size=4, shuffle=False):
        model(xb)  # its step: 2 batches of 4 per update, global batch 8
    second = OneDeviceStrategy("cpu")
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    plain = [float(F.mse_loss(net(x), y))]  # without towers: the one batch of 16's mean loss
    model, _ = second.prepare(net)
    losses = [float(towers.compute_average_loss(F.mse_loss(model(xb), yb, reduction="none").mean(dim=1)))
              for xb, yb in second.distribute_dataset((x, y), global_batch_size=16, shuffle=False)]
    assert losses == pytest.approx(plain, rel=1e-6)  # divided by 16, not by the first strategy's 8
