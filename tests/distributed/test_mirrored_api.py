"""MirroredStrategy on 2 CPU replicas: reductions over ragged batches, object exchange, options
(fp16 skip decisions, gradient compression, bucket size, unused parameters) and clear errors.

One spawn runs every check (each in its own try block, so one failure does not hide the others)
and returns plain results; the tests below assert on them in this process.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster.info import ProcessInfo

pytestmark = pytest.mark.timeout(240)


def _data(n: int = 22) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(36, 3)
        self.unused_head = nn.Linear(36, 3)

    def forward(self, x):
        return self.body(x.flatten(1))


def train(strategy, *, model: str = "cnn", gbs: int = 8) -> dict:
    """A short custom loop; returns final parameters and per-step global losses."""
    with strategy.scope():
        torch.manual_seed(0)
        net = _WithUnused() if model == "unused" else nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net, opt = strategy.prepare(net, opt)

    def step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(net(x), y, reduction="none"))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses = []
    for x, y in strategy.distribute_dataset(_data(), gbs, seed=3):
        losses.append(strategy.reduce("sum", strategy.run(step, args=(x, y))))
    return {"params": [p.detach().clone() for p in strategy.unwrap(net).parameters()], "losses": torch.stack(losses)}


def _checks() -> dict:
    out: dict = {}

    def check(name):
        def wrap(fn):
            try:
                out[name] = fn()
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which asserts
                out[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            return fn
        return wrap

    s = towers.strategy_from_env(timeout_s=60)
    rank = s.replica_id

    @check("identity")
    def _():
        return {"type": type(s).__name__, "replicas": s.num_replicas_in_sync, "rank": rank, "chief": s.is_chief,
                "device": str(s.device)}

    @check("reduce")
    def _():
        ragged = torch.tensor([1.0, 2.0, 3.0]) if rank == 0 else torch.tensor([10.0])
        empty = torch.tensor([1.0, 2.0, 3.0]) if rank == 0 else torch.zeros(0)
        return {
            "mean_axis0": s.reduce("mean", ragged, axis=0).item(),
            "sum_axis0": s.reduce("sum", ragged, axis=0).item(),
            "max_axis0": s.reduce("max", ragged, axis=0).item(),
            "min_axis0": s.reduce("min", ragged, axis=0).item(),
            "max_empty": s.reduce("max", empty, axis=0).item(),
            "mean_empty": s.reduce("mean", empty, axis=0).item(),
            "mean_elementwise": s.reduce("mean", torch.tensor([float(rank), 4.0])).tolist(),
            "sum_int": s.reduce("sum", rank + 1).item(),
            "mean_rows": s.reduce("mean", torch.full((rank + 1, 2), float(rank)), axis=0).tolist(),
        }

    @check("gather")
    def _():
        value = torch.zeros(3, 2) if rank == 0 else torch.ones(1, 2)
        empty = torch.zeros(0, 2) if rank == 1 else torch.full((2, 2), 5.0)
        return {"ragged": s.gather(value).tolist(), "with_empty": s.gather(empty).tolist(),
                "axis1": s.gather(torch.full((2, rank + 1), float(rank)), axis=1).tolist()}

    @check("objects")
    def _():
        s.barrier()
        return {"broadcast": s.broadcast_object({"from": rank}, src=1), "gathered": s.all_gather_object(rank * 10)}

    @check("plain")
    def _():
        return train(towers.MirroredStrategy(timeout_s=60))

    @check("small_buckets")
    def _():
        return train(towers.MirroredStrategy(timeout_s=60, bucket_cap_mb=0.0005))

    for compression in ("fp16", "bf16", "powersgd"):
        check(f"compression_{compression}")(lambda c=compression: train(towers.MirroredStrategy(
            timeout_s=60, gradient_compression=c, powersgd_start_iter=2)))

    @check("precision_bf16")
    def _():
        return train(towers.MirroredStrategy(timeout_s=60, precision="bf16"))

    @check("find_unused")
    def _():
        return train(towers.MirroredStrategy(timeout_s=60, find_unused_parameters=True), model="unused")

    @check("fp16_skip")
    def _():
        st = towers.MirroredStrategy(timeout_s=60, precision="fp16")
        torch.manual_seed(0)
        net = nn.Linear(2, 1)
        model, opt = st.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        before = net.weight.detach().clone()
        scale0 = st.precision.scale

        def step(bad):
            x = torch.tensor([[float("inf") if bad else 1.0, 1.0]])
            st.backward(towers.compute_average_loss(model(x).sum(dim=1), global_batch_size=2))  # 1 example x 2
            opt.step()
            opt.zero_grad()
            return opt.last_step_skipped

        skipped_inf = st.run(step, args=(rank == 1,))  # only rank 1 overflows
        unchanged = torch.equal(net.weight, before)
        scale1 = st.precision.scale
        skipped_ok = st.run(step, args=(False,))
        return {"skipped_inf": skipped_inf, "unchanged": unchanged, "scales": [scale0, scale1],
                "skipped_ok": skipped_ok, "state": st.state_dict(model)["precision"]["scale"]}

    # --- errors -------------------------------------------------------------------------------------
    @check("err_shape")
    def _():
        towers.MirroredStrategy(timeout_s=60).prepare(nn.Sequential(nn.Linear(4, 3 + rank), nn.Linear(3 + rank, 1)))

    @check("err_unused")
    def _():
        train(towers.MirroredStrategy(timeout_s=60), model="unused")

    @check("err_unused_no_optimizer")
    def _():
        st = towers.MirroredStrategy(timeout_s=60)
        model, _ = st.prepare(_WithUnused())
        for _ in range(2):
            model(torch.zeros(2, 1, 6, 6)).sum().backward()

    @check("err_run_unprepared")
    def _():
        towers.MirroredStrategy(timeout_s=60).run(lambda: None)

    @check("err_original_module")
    def _():
        st = towers.MirroredStrategy(timeout_s=60)
        net = nn.Linear(3, 1)
        _, opt = st.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))

        def step():
            net(torch.ones(2, 3)).sum().backward()  # the original module, not the prepared one
            opt.step()

        st.run(step)

    @check("err_prepare_twice")
    def _():
        st = towers.MirroredStrategy(timeout_s=60)
        model, _ = st.prepare(nn.Linear(2, 2))
        st.prepare(model)

    @check("err_batch_size")
    def _():
        s.distribute_dataset(torch.arange(10), 1)

    @check("err_tiny_dataset")
    def _():
        s.distribute_dataset(torch.arange(1), 2)

    @check("after_errors")
    def _():  # the process group still works after every error above
        return s.reduce("sum", torch.tensor(1.0)).item()

    @check("mwms")
    def _():
        st = towers.get_strategy("mwms", timeout_s=60)
        return {"name": st.name, "replicas": st.num_replicas_in_sync, "chief": st.is_chief}

    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return towers.spawn(_checks, 2, timeout_s=180)


@pytest.fixture(scope="module")
def reference() -> dict:
    return {model: train(towers.OneDeviceStrategy("cpu", info=ProcessInfo()), model=model) for model in ("cnn", "unused")}


def _ok(results, name):
    for r in results:
        assert not (isinstance(r[name], dict) and "error" in r[name]), r[name].get("trace", r[name])
    return [r[name] for r in results]


def _error(results, name) -> list[str]:
    messages = [r[name]["error"] if isinstance(r[name], dict) and "error" in r[name] else None for r in results]
    assert all(messages), f"{name}: expected an error on every rank, got {[r[name] for r in results]}"
    return messages


def test_identity(results):
    ids = _ok(results, "identity")
    assert [(i["type"], i["replicas"], i["rank"], i["chief"], i["device"]) for i in ids] == [
        ("MirroredStrategy", 2, 0, True, "cpu"), ("MirroredStrategy", 2, 1, False, "cpu")]
    assert _ok(results, "mwms") == [{"name": "multi_worker_mirrored", "replicas": 2, "chief": c} for c in (True, False)]


def test_reduce_is_exact_over_ragged_and_empty_shares(results):
    for r in _ok(results, "reduce"):
        assert r["mean_axis0"] == pytest.approx(16 / 4)  # sum of values over sum of counts, not mean of means
        assert (r["sum_axis0"], r["max_axis0"], r["min_axis0"]) == (16.0, 10.0, 1.0)
        assert r["max_empty"] == 3.0 and r["mean_empty"] == pytest.approx(2.0)
        assert r["mean_elementwise"] == [0.5, 4.0] and r["sum_int"] == 3
        assert r["mean_rows"] == pytest.approx([2 / 3, 2 / 3])


def test_gather_handles_ragged_and_empty_shares(results):
    for r in _ok(results, "gather"):
        assert r["ragged"] == [[0.0, 0.0]] * 3 + [[1.0, 1.0]]
        assert r["with_empty"] == [[5.0, 5.0]] * 2
        assert r["axis1"] == [[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]


def test_objects_and_barrier(results):
    assert _ok(results, "objects") == [{"broadcast": {"from": 1}, "gathered": [0, 10]}] * 2


@pytest.mark.parametrize("name", ["plain", "small_buckets", "find_unused"])
def test_exact_options_match_one_device(results, reference, name):
    ref = reference["unused" if name == "find_unused" else "cnn"]
    for r in _ok(results, name):
        assert torch.allclose(r["losses"], ref["losses"], atol=1e-5)
        for p, q in zip(r["params"], ref["params"]):
            assert torch.allclose(p, q, atol=1e-5)


@pytest.mark.parametrize("name,atol", [("compression_fp16", 1e-3), ("compression_bf16", 2e-2),
                                       ("precision_bf16", 5e-2), ("compression_powersgd", None)])
def test_approximate_options_stay_close_and_replicas_agree(results, reference, name, atol):
    runs, reference = _ok(results, name), reference["cnn"]
    for p, q in zip(runs[0]["params"], runs[1]["params"]):
        assert torch.equal(p, q)  # replicas never drift apart
    if atol is None:  # PowerSGD: exact (vanilla SUM) for its first 2 steps, low-rank afterwards
        assert torch.allclose(runs[0]["losses"][:3], reference["losses"][:3], atol=1e-5)
        assert all(torch.isfinite(p).all() for p in runs[0]["params"])
        return
    assert torch.allclose(runs[0]["losses"], reference["losses"], atol=atol)
    for p, q in zip(runs[0]["params"], reference["params"]):
        assert torch.allclose(p, q, atol=atol)


def test_fp16_skip_decision_is_the_same_on_every_replica(results):
    runs = _ok(results, "fp16_skip")
    for r in runs:  # rank 1 alone saw inf: both skip, both halve the scale, both step next time
        assert r["skipped_inf"] and r["unchanged"] and not r["skipped_ok"]
        assert r["scales"][1] == r["scales"][0] / 2
    assert runs[0]["state"] == runs[1]["state"]


def test_model_differing_across_replicas_names_the_parameter_and_ranks(results):
    for message in _error(results, "err_shape"):
        assert message.startswith("InvalidArgumentError: ") and "'0.weight' with shape [3, 4]" in message  # a ValueError
        assert "shape [4, 4]" in message and "on rank 1" in message


def test_unused_parameters_are_named_with_the_fix(results):
    for message in _error(results, "err_unused"):
        assert "unused_head.weight" in message and "find_unused_parameters=True" in message
    for message in _error(results, "err_unused_no_optimizer"):
        assert "unused_head.weight" in message and "find_unused_parameters=True" in message
        assert "Expected to have finished reduction" not in message


def test_misuse_is_explained(results):
    assert all("before any model was prepared" in m for m in _error(results, "err_run_unprepared"))
    assert all("not called since the last update" in m for m in _error(results, "err_original_module"))
    assert all("already prepared" in m for m in _error(results, "err_prepare_twice"))
    assert all("number of replicas (2)" in m for m in _error(results, "err_batch_size"))
    assert all("fewer than the 2 replicas" in m for m in _error(results, "err_tiny_dataset"))
    assert _ok(results, "after_errors") == [2.0, 2.0]


def _empty_share_without_padding() -> None:
    strategy = towers.MirroredStrategy(timeout_s=30)
    torch.manual_seed(0)
    net = nn.Linear(36, 2)
    model, opt = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))

    def step(x):
        towers.compute_average_loss(model(x.view(x.size(0), -1)).sum(dim=1)).backward()  # view(0, -1) fails on 0 rows
        opt.step()

    for x in strategy.distribute_dataset(torch.randn(3, 6, 6), 2, shuffle=False):  # last batch: 1 example
        strategy.run(step, args=(x,))


def test_a_step_that_fails_on_an_empty_share_is_explained():
    with pytest.raises(towers.launch.SpawnError) as info:
        towers.spawn(_empty_share_without_padding, 2, timeout_s=90)
    message = str(info.value)
    assert "rank 1 of 2 failed" in message
    assert "Replica 1 got an empty share of global batch 1" in message and "pad_empty_batches=True" in message
