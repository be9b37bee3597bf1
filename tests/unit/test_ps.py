"""ParameterServerStrategy pieces that need no process: roles, bad input, sharding, layouts, optimizer mapping."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import towers
from towers.cluster.info import ClusterSpec, ProcessInfo, TaskInfo
from towers.strategies.parameter_server.roles import resolve_roles
from towers.strategies.parameter_server.sharding import (
    FlatLayout,
    ParamSpec,
    assign_shards,
    model_signature,
    signature_mismatch,
)
from towers.strategies.parameter_server.worker import _optimizer_layout


def _info(rank: int = 0, world: int = 3, **kw) -> ProcessInfo:
    return ProcessInfo(rank=rank, world_size=world, local_rank=rank, local_world_size=world, master_port=29500, **kw)


# --- roles ----------------------------------------------------------------------------------------
def test_last_ranks_are_ps_tasks_and_rank_zero_is_the_chief_worker():
    roles = [resolve_roles(_info(r, 4, num_ps=2, strategy="ps"), None) for r in range(4)]
    assert [(x.is_ps, x.index) for x in roles] == [(False, 0), (False, 1), (True, 0), (True, 1)]
    assert roles[0].ps_ranks == (2, 3) and roles[0].num_workers == 2 and roles[0].bind_host == "127.0.0.1"
    assert resolve_roles(_info(2, 3), None).num_ps == 1  # no launcher setting: one ps task


def test_tf_config_roles_and_bind_address():
    spec = ClusterSpec({"chief": ["h0:2222"], "worker": ["h1:2222"], "ps": ["h2:2222"]})
    info = ProcessInfo(rank=2, world_size=3, task=TaskInfo("ps", 0), cluster=spec, num_ps=1, master_port=2222)
    roles = resolve_roles(info, None)
    assert roles.is_ps and roles.index == 0 and roles.bind_host == "h2"
    bad = ProcessInfo(rank=0, world_size=3, task=TaskInfo("ps", 0), cluster=spec, num_ps=1, master_port=2222)
    with pytest.raises(ValueError, match="ps tasks must be the last ranks"):
        resolve_roles(bad, None)


@pytest.mark.parametrize("num_ps, world, message", [
    (3, 3, r"num_ps=3 leaves no worker: the job has 3 process\(es\).*Expected num_ps < 3"),
    (1, 1, r"num_ps=1 leaves no worker.*towers launch --strategy ps --num-ps 1"),
    (0, 3, r"num_ps must be an integer >= 1. Received: num_ps=0"),
])
def test_num_ps_without_workers_is_refused(num_ps, world, message):
    with pytest.raises(ValueError, match=message):
        resolve_roles(_info(0, world), num_ps)


def test_num_ps_contradicting_the_launcher_is_refused():
    with pytest.raises(ValueError, match=r"num_ps=2 was passed, but the job was launched with 1 ps task"):
        resolve_roles(_info(0, 4, num_ps=1), 2)


def test_evaluator_is_refused():
    spec = ClusterSpec({"chief": ["h0:1"], "ps": ["h1:1"], "evaluator": ["h2:1"]})
    with pytest.raises(ValueError, match="evaluator"):
        resolve_roles(ProcessInfo(task=TaskInfo("evaluator", 0), cluster=spec), None)


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "hogwild"}, r"mode must be one of \('async', 'sync', 'diloco'\). Received: mode='hogwild'"),
    ({"mode": "sync", "staleness": 2}, "sync mode is never stale"),
    ({"staleness": -1}, "staleness must be None or an integer >= 0"),
    ({"timeout_s": 0}, "timeout_s must be > 0"),
    ({"num_ps": 5}, "leaves no worker"),
])
def test_bad_arguments_fail_before_any_connection(kwargs, message):
    with pytest.raises(ValueError, match=message):
        towers.ParameterServerStrategy(info=_info(0, 3), **kwargs)


def test_registered_under_ps_names():
    with pytest.raises(ValueError, match="mode must be one of"):
        towers.get_strategy("parameter-server", info=_info(), mode="bad")


# --- sharding -------------------------------------------------------------------------------------
def test_greedy_sharding_puts_the_largest_tensor_on_the_least_loaded_ps():
    specs = [ParamSpec(f"p{i}", (n,), "float32") for i, n in enumerate([10, 1000, 300, 300, 5, 500])]
    shards = assign_shards(specs, 2)
    assert shards == [[0, 1, 4], [2, 3, 5]]  # 1000+10+5 | 500+300+300
    assert sorted(i for s in assign_shards(specs, 3) for i in s) == list(range(6))
    assert assign_shards(specs[:1], 2) == [[0], []]  # more ps tasks than parameters: an empty shard


def test_seed_cnn_sharding_balances_two_ps_tasks():
    from towers.models import SeedCNN

    specs = model_signature(SeedCNN().named_parameters())
    loads = [sum(specs[i].nbytes for i in shard) for shard in assign_shards(specs, 2)]
    assert sum(loads) == 4 * sum(s.numel for s in specs) and min(loads) > 0


def test_flat_layout_views_are_aligned_typed_and_share_memory():
    specs = [ParamSpec("a", (3, 5), "float32"), ParamSpec("b", (7,), "float64"), ParamSpec("c", (2,), "float32")]
    layout = FlatLayout(specs)
    assert all(o % 64 == 0 for o in layout.offsets) and layout.nbytes % 64 == 0
    buf = layout.new_buffer()
    a, b, c = layout.views(buf)
    assert (a.shape, a.dtype, b.dtype, c.shape) == ((3, 5), torch.float32, torch.float64, (2,))
    a.fill_(1.0)
    c.fill_(2.0)
    b.fill_(3.0)
    f32, f64 = layout.region_views(buf)  # float32 params first (a, c), then float64
    assert f32.sum().item() == 15 + 4 and f64.sum().item() == 21


def test_signature_mismatch_names_the_first_difference():
    one = model_signature(nn.Linear(4, 2).named_parameters())
    other = model_signature(nn.Linear(4, 3).named_parameters())
    assert signature_mismatch(one, one) is None
    assert signature_mismatch(one, other) == "expected 'weight' (2, 4) float32, received 'weight' (3, 4) float32"
    assert "expected 2 parameters, received 1" in signature_mismatch(one, one[:1])


def test_optimizer_layout_maps_ps_local_indices_to_torch_numbering():
    net = nn.Sequential(nn.Linear(2, 50), nn.Linear(50, 1))
    params = list(net.parameters())  # w0 (100), b0 (50), w1 (50), b1 (1)
    opt = torch.optim.SGD([{"params": [params[2], params[0]], "lr": 1.0}, {"params": [params[3]]}], lr=0.1)
    shards = assign_shards(model_signature(net.named_parameters()), 2)
    assert shards == [[0, 3], [1, 2]]  # w0+b1 | b0+w1
    groups, local_to_global, group_ids = _optimizer_layout(opt, params, shards)
    # torch numbers the optimizer's params w1=0, w0=1, b1=2 (group order); b0 is in no group: not optimized
    assert groups[0][0] == ({k: v for k, v in opt.param_groups[0].items() if k != "params"}, [0])
    assert [positions for _, positions in groups[0]] == [[0], [1]] and local_to_global[0] == [1, 2]
    assert [positions for _, positions in groups[1]] == [[1]] and local_to_global[1] == [0]
    assert group_ids == [[0, 1], [0]]


def test_optimizer_with_a_foreign_tensor_is_refused():
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD([*net.parameters(), nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match=r"holds a tensor of shape \(3,\) that is not a parameter of the model"):
        _optimizer_layout(opt, list(net.parameters()), [[0, 1]])


def test_the_ps_steps_with_fast_kernels_and_reports_the_users_choice():
    from towers.strategies.parameter_server.requests import build_optimizer, report_kernels

    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))]
    spec = {"cls": "Adam", "defaults": {"lr": 0.1, "foreach": None, "fused": None},
            "groups": [({"lr": 0.1, "foreach": None, "fused": None}, [0]), ({"lr": 0.2, "foreach": False}, [1])]}
    optimizer = build_optimizer(spec, params, 0)
    assert optimizer.param_groups[0]["fused"] is True  # left to torch: one fused kernel
    assert optimizer.param_groups[1]["foreach"] is False and not optimizer.param_groups[1].get("fused")  # the user's
    reference = [p.detach().clone().requires_grad_() for p in params]
    plain = torch.optim.Adam([{"params": [reference[0]], "lr": 0.1}, {"params": [reference[1]], "lr": 0.2}])
    for _ in range(3):
        for p, r in zip(params, reference):
            p.grad = torch.ones_like(p)
            r.grad = torch.ones_like(r)
        optimizer.step()
        plain.step()
    assert all(torch.allclose(p, r, atol=1e-6) for p, r in zip(params, reference))  # the same maths
    state = report_kernels(optimizer.state_dict())
    assert state["param_groups"][0]["fused"] is None and "_towers_fast" not in state["param_groups"][0]
    plain.load_state_dict(state)  # loads into the user's own optimizer as it was built


# --- every torch optimizer rebuilt on a ps task ---------------------------------------------------
def _torch_optimizers() -> list[str]:
    """Every optimizer class the installed torch exports (the list comes from torch, not from towers)."""
    return [name for name in torch.optim.__all__
            if isinstance(getattr(torch.optim, name), type) and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
            and getattr(torch.optim, name) is not torch.optim.Optimizer]


def _through_the_wire(value):
    """``value`` as a ps task receives it: encoded as JSON + tensor bytes, decoded without unpickling."""
    from towers.strategies.parameter_server.wire import decode, encode

    raw, tensors = encode(value)
    return decode(raw, torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors else None)


def test_the_list_of_torch_optimizers_is_torchs_own():
    from towers.strategies.parameter_server.requests import OPTIMIZERS, REFUSED_OPTIMIZERS

    assert {"SGD", "Adam", "AdamW"} <= set(_torch_optimizers())
    assert sorted(OPTIMIZERS) == sorted(set(_torch_optimizers()) - set(REFUSED_OPTIMIZERS))


@pytest.mark.parametrize("name", _torch_optimizers())
def test_every_torch_optimizer_steps_on_a_ps_task_like_plain_torch(name):
    """The worker's spec crosses the wire, the ps task builds the optimizer over its shard and steps the pushed
    gradients; the user's own optimizer stepping the same gradients in this process is the reference."""
    from towers.strategies.parameter_server.requests import (
        REFUSED_OPTIMIZERS,
        build_optimizer,
        optimizer_spec,
        report_kernels,
    )

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Linear(3, 2, bias=False))  # 2-D only: Muon's domain
    params = list(net.parameters())
    cls = getattr(torch.optim, name)
    shards = [[0, 1]]
    if name in REFUSED_OPTIMIZERS:  # refused at prepare, with the reason and what to use
        with pytest.raises(ValueError, match=rf"cannot run torch.optim.{name} on its ps tasks.*Use "):
            _optimizer_layout(cls(params, lr=0.01), params, shards)
        return
    # two groups with their own lr: per-group values must reach the ps
    user = cls([{"params": [params[0]]}, {"params": [params[1]], "lr": 0.03}], lr=0.01)
    groups, _, _ = _optimizer_layout(user, params, shards)
    spec = _through_the_wire(optimizer_spec(user, groups[0]))
    ps_params = [nn.Parameter(p.detach().clone()) for p in params]
    ps_optimizer = build_optimizer(spec, ps_params, 0)
    assert type(ps_optimizer) is cls and [g["lr"] for g in ps_optimizer.param_groups] == [0.01, 0.03]
    for _ in range(2):  # the second step reads the state the first one made
        grads = [torch.randn_like(p) for p in params]
        for p, q, g in zip(params, ps_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        user.step()
        ps_optimizer.step()
    for p, q in zip(params, ps_params):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6)
    # the ps's state comes back (GET_STATE) and loads into the user's plain optimizer
    user.load_state_dict(_through_the_wire(report_kernels(ps_optimizer.state_dict())))


def test_a_tensor_learning_rate_travels_as_its_number():
    from towers.strategies.parameter_server.requests import build_optimizer, optimizer_spec

    params = [nn.Parameter(torch.randn(5))]
    user = torch.optim.Adam(params, lr=torch.tensor(0.01), betas=(torch.tensor(0.8), torch.tensor(0.9)))
    groups, _, _ = _optimizer_layout(user, params, [[0]])
    spec = _through_the_wire(optimizer_spec(user, groups[0]))
    assert spec["defaults"]["lr"] == pytest.approx(0.01) and spec["groups"][0][0]["betas"] == pytest.approx((0.8, 0.9))
    ps_params = [nn.Parameter(params[0].detach().clone())]
    ps_optimizer = build_optimizer(spec, ps_params, 0)
    for _ in range(2):
        grad = torch.randn(5)
        params[0].grad, ps_params[0].grad = grad.clone(), grad.clone()
        user.step()
        ps_optimizer.step()
    torch.testing.assert_close(ps_params[0].detach(), params[0].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value,shown", [
    (lambda step: 0.1, "function"),
    (torch.ones(3), "a tensor of shape (3,)"),
])
def test_a_hyperparameter_that_cannot_travel_is_refused_at_prepare_naming_it(value, shown):
    params = [nn.Parameter(torch.randn(2))]
    user = torch.optim.SGD([{"params": params, "schedule": value}], lr=0.1)
    with pytest.raises(ValueError, match=rf"param group 0 holds 'schedule'.*Received: .*{re.escape(shown)}.*"
                                         r"Set 'schedule' to a number"):
        _optimizer_layout(user, params, [[0]])
