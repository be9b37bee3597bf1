"""DiLoCo's options and pieces without processes: bad input refused before anything connects, with the value and the
fix; the outer optimizers; fragments; the bf16/int8 codec with error feedback; the ps's check of a compressed push;
the end of a pass, which waits for every worker's window and hands a dead worker's unpushed window to the others."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import towers
from towers.cluster.info import ProcessInfo
from towers.strategies.parameter_server.diloco import split_fragments
from towers.strategies.parameter_server.diloco_codec import DeltaEncoder, unpack_delta
from towers.strategies.parameter_server.diloco_options import DiLoCoOptions, diloco_options
from towers.strategies.parameter_server.dispatch import Dispatcher
from towers.strategies.parameter_server.requests import RequestError
from towers.strategies.parameter_server.sharding import FlatLayout, ParamSpec, model_signature
from towers.strategies.registry import check_strategy_options


def _info(rank: int = 0, world: int = 3) -> ProcessInfo:
    return ProcessInfo(rank=rank, world_size=world, local_rank=rank, local_world_size=world, master_port=29500)


@pytest.mark.parametrize("kwargs, message", [
    ({"sync_every": 0}, r"sync_every must be a positive integer. Received: sync_every=0. Pass e.g. sync_every=8"),
    ({"sync_every": 2.5}, r"sync_every must be a positive integer. Received: sync_every=2.5"),
    ({"sync_every": True}, r"sync_every must be a positive integer. Received: sync_every=True"),
    ({"fragments": -1}, r"fragments must be a positive integer. Received: fragments=-1"),
    ({"outer_optimizer": "adamw"}, r"outer_optimizer must be one of \('nesterov', 'sgd'\).*Received: "
                                   r"outer_optimizer='adamw'. Use 'nesterov'"),
    ({"outer_optimizer": 3}, r"a name or a callable .*Received: a int"),
    ({"outer_lr": 0}, r"outer_lr must be a number > 0. Received: outer_lr=0"),
    ({"outer_momentum": 1.0}, r"outer_momentum must be a number in \[0, 1\). Received: outer_momentum=1.0"),
    ({"outer_momentum": 0}, r"Nesterov momentum needs a momentum > 0.*Use outer_optimizer='sgd'"),
    ({"outer_optimizer": lambda ps: torch.optim.SGD(ps, lr=1), "outer_lr": 0.5}, r"a callable sets its own"),
    ({"outer_mode": "hogwild"}, r"outer_mode must be one of \('sync', 'async'\). Received: outer_mode='hogwild'"),
    ({"compression": "int2"}, r"compression must be one of \('float32', 'bf16', 'int8', 'int4'\).*Received: "
                              r"compression='int2'. Use 'bf16'"),
    ({"staleness": 2}, r"staleness bounds async outer rounds.*Received: staleness=2 with outer_mode='sync'. Drop "
                       r"staleness, or pass outer_mode='async'"),
])
def test_bad_diloco_options_fail_before_any_connection(kwargs, message):
    with pytest.raises(ValueError, match=message):
        towers.ParameterServerStrategy(info=_info(), mode="diloco", **kwargs)


def test_diloco_options_need_mode_diloco_and_the_ps_strategy():
    with pytest.raises(ValueError, match=r"sync_every are DiLoCo's options. Received: mode='sync'. Pass mode='diloco'"):
        towers.ParameterServerStrategy(info=_info(), mode="sync", sync_every=4)
    with pytest.raises(ValueError, match=r"mode='diloco' runs under ParameterServerStrategy \(--strategy ps\)"):
        towers.HybridStrategy(info=_info(), mode="diloco")
    with pytest.raises(TypeError, match=r"DiLoCo's options \(mode='diloco'\) are sync_every"):
        diloco_options("diloco", None, overlap=False, strategy="ps", options={"sync_evry": 4})
    # async outer rounds take the staleness bound; the defaults are DiLoCo's
    assert diloco_options("diloco", 1, overlap=False, strategy="ps", options={"outer_mode": "async"}) is not None
    assert diloco_options("sync", None, overlap=False, strategy="ps", options={"sync_every": None}) is None
    assert diloco_options("diloco", None, overlap=True, strategy="ps", options={}).overlap  # replies read a step late
    assert DiLoCoOptions() == DiLoCoOptions(sync_every=8, outer_optimizer="nesterov", compression="float32", fragments=1)


def test_diloco_options_from_the_command_line_are_checked_by_kind():
    with pytest.raises(ValueError, match=r"each strategy option is one KEY=VALUE. Received: "
                                         r"mode='diloco,sync_every=8'. Give each its own flag"):
        towers.ParameterServerStrategy(info=_info(), mode="diloco,sync_every=8")
    check_strategy_options("ps", {"mode": "diloco", "sync_every": 8, "outer_lr": 0.5, "compression": "int8"})
    with pytest.raises(ValueError, match=r"takes sync_every as an integer or null. Received: --strategy-option "
                                         r"sync_every='often'"):
        check_strategy_options("ps", {"mode": "diloco", "sync_every": "often"})


def test_outer_optimizers_by_name_and_from_code():
    params = [nn.Parameter(torch.zeros(3))]
    nesterov = DiLoCoOptions().build_outer(params)
    assert isinstance(nesterov, torch.optim.SGD)
    assert {k: nesterov.defaults[k] for k in ("lr", "momentum", "nesterov")} == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    sgd = DiLoCoOptions(outer_optimizer="sgd", outer_lr=0.5).build_outer(params)
    assert {k: sgd.defaults[k] for k in ("lr", "momentum", "nesterov")} == {"lr": 0.5, "momentum": 0.0, "nesterov": False}
    adam = DiLoCoOptions(outer_optimizer=lambda ps: torch.optim.Adam(ps, lr=0.1)).build_outer(params)
    assert isinstance(adam, torch.optim.Adam)
    with pytest.raises(TypeError, match="outer_optimizer must return a torch.optim.Optimizer. Received: a list"):
        DiLoCoOptions(outer_optimizer=lambda ps: list(ps)).build_outer(params)


def test_fragments_are_contiguous_non_empty_and_refused_beyond_the_parameter_count():
    specs = model_signature(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).named_parameters())
    for f in (1, 2, 3, 4):
        parts = split_fragments(specs, f)
        assert len(parts) == f and all(parts) and sorted(i for p in parts for i in p) == list(range(len(specs)))
        assert [min(p) for p in parts] == sorted(min(p) for p in parts)  # in model order
    # bytes 1024, 128, 512, 16: the first weight alone passes half of them
    assert split_fragments(specs, 2) == [{0}, {1, 2, 3}]
    with pytest.raises(ValueError, match=r"fragments=5 cannot divide a model of 4 parameter tensor\(s\).*Use "
                                         r"fragments <= 4"):
        split_fragments(specs, 5)


@pytest.mark.parametrize("codec, ratio", [("bf16", 2), ("int8", 4), ("int4", 8)])
def test_compressed_changes_keep_their_residual_and_nothing_is_lost(codec, ratio):
    torch.manual_seed(0)
    encoder = DeltaEncoder(codec)
    layout = FlatLayout([ParamSpec("w", (64,), "float32"), ParamSpec("b", (5,), "float32")])
    total_sent, total_true = torch.zeros(64), torch.zeros(64)
    for _ in range(20):
        delta = torch.randn(64) * 1e-3
        packed = encoder.pack([(0, delta)])
        assert packed["values"][0].numel() * packed["values"][0].element_size() * ratio == 4 * 64
        flat = unpack_delta(packed, layout, [True, False], None, ps_index=0)
        w, b = layout.views(flat)
        assert torch.equal(b, torch.zeros(5))  # a parameter outside the fragment stays zero
        total_sent += w
        total_true += delta
    # error feedback: what was sent plus what is kept is every change, to float rounding
    assert torch.allclose(total_sent + encoder._residual[0], total_true, atol=1e-6)
    assert (total_sent - total_true).abs().max() < {"bf16": 1e-4, "int8": 1e-2, "int4": 2e-2}[codec]


def test_a_compressed_push_that_does_not_fit_the_shard_is_refused_as_bad_input():
    layout = FlatLayout([ParamSpec("w", (4,), "float32")])
    bad = [{"codec": "int2", "values": []},
           {"codec": "int4", "values": [torch.zeros(4, dtype=torch.uint8)], "scales": torch.ones(1)},  # 2 bytes hold 4
           {"codec": "int8", "values": [torch.zeros(4, dtype=torch.int8)]},  # no scales
           {"codec": "bf16", "values": [torch.zeros(3, dtype=torch.bfloat16)]},  # wrong size
           {"codec": "bf16", "values": [torch.zeros(4, dtype=torch.float64)]},  # wrong dtype
           {"codec": "bf16", "values": []}]  # wrong count
    for packed in bad:
        with pytest.raises(RequestError, match="a compressed DiLoCo push does not match the shard"):
            unpack_delta(packed, layout, None, None, ps_index=0)


# --- the end of a DiLoCo pass (ps task 0's dispatcher, without processes) --------------------------------------
class _Server:
    """What the dispatcher reads of a ParameterServer: the lock, the live workers, a bounded wait."""

    def __init__(self, workers: int):
        self.cond = threading.Condition()
        self.links = [None] * workers
        self.dead: dict[int, str] = {}

    def active(self) -> set[int]:
        return {w for w in range(len(self.links)) if w not in self.dead}

    def wait(self, ready, what, missing) -> None:
        if not self.cond.wait_for(ready, timeout=10.0):
            raise TimeoutError(f"{what} waits for {sorted(missing())}")


def _ask(d: Dispatcher, w: int, step: int) -> dict:
    spec = {"num_examples": 8, "global_batch_size": 4, "drop_remainder": False, "start": 0, "epoch": 0,
            "num_replicas": 2, "flush": True}
    return d.next(w, {"key": "d1.1", "step": step, "spec": spec})


def _together(d: Dispatcher, requests: list[tuple[int, int]]) -> list[dict]:
    answers: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda i=i, w=w, s=s: answers.__setitem__(i, _ask(d, w, s)))
               for i, (w, s) in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return [answers[i] for i in range(len(requests))]


def test_a_pass_ends_only_after_every_window_is_pushed_and_a_worker_dead_before_its_push_is_redone():
    server = _Server(2)
    d = Dispatcher(server)  # type: ignore[arg-type]
    first = _together(d, [(0, 0), (1, 0)])  # each worker leases its 2 own shares
    assert [a["units"] for a in first] == [[[0, 0], [1, 0]], [[0, 1], [1, 1]]]
    # both trained their shares; no push yet (the window is longer): the pass does not end, each must push first
    flush = _together(d, [(0, 2), (1, 2)])
    assert [a["kind"] for a in flush] == ["flush", "flush"]
    assert flush[0]["units"] == [["d1.1", 0, 0], ["d1.1", 1, 0]]
    # worker 1 dies before its push arrives; worker 0's push is applied
    server.dead[1] = "killed"
    with server.cond:
        d.on_dead(1)
        d.applied(0, flush[0]["units"])
    # worker 0 asks again: it trains worker 1's two shares in the same pass, pushes, and only then the pass ends
    assert _ask(d, 0, 2) == {"kind": "unit", "units": [[0, 1]]}
    assert _ask(d, 0, 3) == {"kind": "unit", "units": [[1, 1]]}
    again = _ask(d, 0, 4)
    assert again == {"kind": "flush", "units": [["d1.1", 0, 1], ["d1.1", 1, 1]]}
    with server.cond:
        d.applied(0, again["units"])
    stop = _ask(d, 0, 4)
    assert stop["kind"] == "stop" and stop["examples"] == 8 == stop["expected"]


def test_units_with_no_push_are_handed_in_as_computed_and_the_pass_ends():
    server = _Server(2)
    d = Dispatcher(server)  # type: ignore[arg-type]
    _together(d, [(0, 0), (1, 0)])
    flush = _together(d, [(0, 2), (1, 2)])  # an evaluation pass: nothing pushes these
    for w, answer in enumerate(flush):
        assert d.next(w, {"computed": answer["units"]}) == {}
    stops = _together(d, [(0, 2), (1, 2)])
    assert [(a["kind"], a["examples"]) for a in stops] == [("stop", 8), ("stop", 8)]


def test_int4_packs_two_codes_per_byte_and_an_odd_tensor_round_trips():
    layout = FlatLayout([ParamSpec("w", (5,), "float32")])
    delta = torch.tensor([0.7, -0.7, 0.1, 0.0, -0.32])
    packed = DeltaEncoder("int4").pack([(0, delta)])
    assert packed["values"][0].dtype == torch.uint8 and packed["values"][0].numel() == 3
    w, = layout.views(unpack_delta(packed, layout, None, None, ps_index=0))
    assert torch.allclose(w, torch.tensor([0.7, -0.7, 0.1, 0.0, -0.3]), atol=1e-6)  # codes 7, -7, 1, 0, -3 of 0.1
