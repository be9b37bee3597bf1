"""The prepared model where torch code copies it, on one process: a plain copy of the user's module.

``copy.deepcopy``, ``pickle``, ``torch.save`` and torch's ``AveragedModel`` (which deep-copies) work on the model
``strategy.prepare`` returned, also inside towers' wrappers (the precision wrapper, ``compile=``); the copy is not
prepared (its forward starts no step). ``torch.compile`` of the prepared model trains as the model does. A model no
process holds whole refuses, naming what works (tests/distributed/test_model_copies.py: under every strategy).
"""

from __future__ import annotations

import contextvars
import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import towers
from ema_support import plain_ema
from towers.strategies import current_replica_context
from towers.strategies._copies import DetachedHook, refuse_copies

DECAY, LR, GBS, ROWS = 0.9, 0.2, 8, 32
RTOL, ATOL = 1e-6, 1e-7  # one process: the same operations as the plain loop, up to the loss's mean vs sum / 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 6, generator=g), torch.randint(0, 4, (ROWS,), generator=g)


def _prepared(**options) -> tuple[towers.Strategy, nn.Module, torch.optim.Optimizer]:
    strategy = towers.OneDeviceStrategy("cpu", **options.pop("strategy_options", {}))
    net = _model()
    model, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9), **options)
    return strategy, model, optimizer


def _train(strategy: towers.Strategy, model: nn.Module, optimizer: torch.optim.Optimizer, after_step=None) -> None:
    """The plain loop a towers script writes: no strategy.run, compute_average_loss, one update per batch.

    Run in a context of its own: a loop without strategy.run leaves its last step's strategy current, as a script's
    does, and the tests after this one start with none."""
    def loop() -> None:
        for x, y in strategy.distribute_dataset(_data(), GBS, shuffle=False):
            towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
            optimizer.step()
            optimizer.zero_grad()
            if after_step is not None:
                after_step()

    contextvars.copy_context().run(loop)


def _plain_ema() -> tuple[nn.Module, AveragedModel]:
    model = _model()
    return model, plain_ema(model, *_data(), lr=LR, decay=DECAY, batch=GBS)


def _close(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=key)


def _starts_a_step(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``module``'s forward on a distributed batch starts a step (sets the replica context), in a fresh context."""
    def forward() -> bool:
        module(x)
        return current_replica_context() is not None

    return contextvars.Context().run(forward)


def test_a_deepcopy_of_the_prepared_model_is_a_plain_copy_that_starts_no_step() -> None:
    strategy, model, optimizer = _prepared()
    _train(strategy, model, optimizer)
    twin = copy.deepcopy(model)
    assert type(twin) is nn.Sequential
    _close(twin.state_dict(), model.state_dict())
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(twin.parameters(), model.parameters()))
    x, _ = next(iter(strategy.distribute_dataset(_data(), GBS, shuffle=False)))
    assert _starts_a_step(model, x)  # the prepared model's forward starts the step of a loop without run
    assert not _starts_a_step(twin, x)  # its copy is not prepared
    hooks = list(twin._forward_pre_hooks.values())
    assert hooks and all(isinstance(h, DetachedHook) and "inert" in repr(h) for h in hooks)


def test_pickle_and_torch_save_of_the_prepared_model_and_of_the_optimizers_state() -> None:
    strategy, model, optimizer = _prepared()
    _train(strategy, model, optimizer)
    x, _ = _data()
    loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded) is nn.Sequential and torch.equal(loaded(x), model(x))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(x), model(x))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)  # the habit: weights only, into a plain module
    buffer.seek(0)
    plain = _model()
    plain.load_state_dict(torch.load(buffer))
    assert torch.equal(plain(x), model(x))
    state = pickle.loads(pickle.dumps(optimizer.state_dict()))
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=LR, momentum=0.9)
    plain_optimizer.load_state_dict(state)
    assert plain_optimizer.state_dict()["state"][0]["momentum_buffer"].shape == (16, 6)


def test_torchs_averaged_model_of_the_prepared_model_is_the_plain_loops_ema() -> None:
    strategy, model, optimizer = _prepared()
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))  # it deep-copies the prepared model
    ema = towers.ExponentialMovingAverage(model, decay=DECAY, strategy=strategy)
    _train(strategy, model, optimizer, lambda: (averaged.update_parameters(model), ema.update()))
    plain_model, plain_averaged = _plain_ema()
    _close(model.state_dict(), plain_model.state_dict())
    _close(averaged.module.state_dict(), plain_averaged.module.state_dict())
    _close(ema.full_state_dict(), plain_averaged.module.state_dict())
    x, _ = _data()
    with torch.no_grad(), ema.average_parameters():
        torch.testing.assert_close(model(x), plain_averaged(x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("options", [{"strategy_options": {"precision": "bf16"}}, {"compile": {"backend": "eager"}}],
                         ids=["precision wrapper", "prepare(compile=)"])
def test_towers_wrappers_copy_and_pickle_as_the_users_module(options: dict) -> None:
    strategy, model, optimizer = _prepared(**options)
    _train(strategy, model, optimizer)
    user = strategy.unwrap(model)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        inner = getattr(twin, "_orig_mod", twin)  # a compiled model copies as torch copies one: compiled again
        assert type(inner) is nn.Sequential
        _close(inner.state_dict(), user.state_dict())
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    averaged.update_parameters(model)
    _close(getattr(averaged.module, "_orig_mod", averaged.module).state_dict(), user.state_dict())


def test_torch_compile_of_the_prepared_model_trains_as_the_model() -> None:
    strategy, model, optimizer = _prepared()
    compiled = torch.compile(model, backend="eager")
    _train(strategy, compiled, optimizer)
    plain_model, _ = _plain_ema()
    _close(model.state_dict(), plain_model.state_dict())


def test_a_model_held_in_parts_refuses_copies_naming_what_works() -> None:
    net = _model()
    refuse_copies(net, "FullyShardedStrategy sharded it with FSDP2 (mesh dp=2)")
    for attempt in (lambda: copy.deepcopy(net), lambda: pickle.dumps(net), lambda: torch.save(net, io.BytesIO()),
                    lambda: AveragedModel(net)):
        with pytest.raises(towers.InvalidTypeError) as caught:
            attempt()
        message = str(caught.value)
        assert isinstance(caught.value, TypeError) and "sharded it with FSDP2 (mesh dp=2)" in message
        assert "Received: " in message and "Sequential" in message
        assert "strategy.full_state_dict(model)" in message and "towers.ExponentialMovingAverage" in message


def test_a_detached_hook_runs_on_the_prepared_model_only() -> None:
    calls = []
    hook = DetachedHook(lambda *args: calls.append(args))
    hook(1, 2)
    assert calls == [(1, 2)]
    for twin in (copy.deepcopy(hook), pickle.loads(pickle.dumps(hook))):
        assert twin(3) is None and calls == [(1, 2)]


def test_a_model_whose_table_rows_live_on_the_ps_tasks_refuses_copies_once_connected() -> None:
    table = towers.ShardedEmbedding(100, 4)
    model = nn.Sequential(table, nn.Linear(4, 2))
    assert type(copy.deepcopy(model)) is nn.Sequential  # not prepared yet: its rows are nowhere, a copy is a copy
    table.connect(object(), 0)  # what strategy.prepare does under ParameterServerStrategy and HybridStrategy
    for attempt in (lambda: copy.deepcopy(model), lambda: pickle.dumps(model), lambda: AveragedModel(model)):
        with pytest.raises(towers.InvalidTypeError, match=r"rows of its ShardedEmbedding\(100, 4\) live on the parameter "
                                                          r"servers' ps tasks.*strategy.full_state_dict\(model\)"):
            attempt()
