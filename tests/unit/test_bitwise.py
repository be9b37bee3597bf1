"""bitwise=True in one process: the tree's order, the maths it keeps, and each misuse refused with the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import towers
from towers.cluster.info import ProcessInfo
from towers.data import shard_bounds
from towers.strategies._bitwise_tree import dyadic_nodes, tree_sum


@pytest.mark.parametrize("num_leaves", [1, 2, 5, 6, 8, 12])
def test_every_split_of_the_leaves_gives_the_trees_bits(num_leaves):
    torch.manual_seed(num_leaves)
    leaves = {(0, i): torch.randn(257) * 10 ** torch.randint(-4, 4, ()) for i in range(num_leaves)}
    levels = max(0, (num_leaves - 1).bit_length())
    zeros = lambda: torch.zeros(257)  # noqa: E731
    root = tree_sum(leaves, levels, 0, num_leaves, zeros)
    for replicas in range(1, num_leaves + 2):  # even shares, uneven ones, and a replica with none
        known = {}
        for r in range(replicas):  # each replica's own subtrees, then the top of the tree from all of them
            first, end = shard_bounds(num_leaves, replicas, r)
            nodes = dyadic_nodes(first, end)
            assert sum(2 ** level for level, _ in nodes) == end - first
            known.update({node: tree_sum(leaves, *node, num_leaves, zeros) for node in nodes})
        assert torch.equal(tree_sum(known, levels, 0, num_leaves, zeros), root), replicas
    assert torch.allclose(root, torch.stack(list(leaves.values())).sum(0), rtol=1e-5, atol=1e-4)  # the same sum


def _data(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _loop(strategy, *, global_batch: int = 8, steps: int = 3, drop_remainder: bool = True, step_fn=None, examples=40,
          manual_accumulation: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = strategy.prepare(model, optimizer)

    def step(x, y):
        if not manual_accumulation:
            optimizer.zero_grad()
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        (loss / 2 if manual_accumulation else loss).backward()
        if not manual_accumulation:
            optimizer.step()
        return loss

    losses = []
    for i, (x, y) in enumerate(strategy.distribute_dataset(_data(examples), global_batch, shuffle=False,
                                                           drop_remainder=drop_remainder)):
        if i == steps:
            break
        losses.append(strategy.reduce("sum", strategy.run(step_fn(model, optimizer) if step_fn else step, args=(x, y))))
        if manual_accumulation and i % 2:  # the habit: step and zero_grad every second batch, outside the step
            optimizer.step()
            optimizer.zero_grad()
    return strategy.unwrap(model), losses


def test_one_process_bitwise_is_the_plain_loops_maths():
    bitwise, losses = _loop(towers.OneDeviceStrategy("cpu", bitwise=True, micro_batch_size=2))
    plain, plain_losses = _loop(towers.OneDeviceStrategy("cpu"))
    for a, b in zip(bitwise.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(losses), torch.stack(plain_losses), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options, match", [
    ({"micro_batch_size": 0}, r"Received: micro_batch_size=0"),
    ({"micro_batch_size": 2, "precision": "bf16"}, r"cannot keep this exact. Received: precision='bf16'"),
    ({"micro_batch_size": 2, "bitwise": "perhaps"}, r"bitwise"),
])
def test_what_cannot_be_bitwise_is_refused_at_construction(options, match):
    with pytest.raises(ValueError, match=match):
        towers.OneDeviceStrategy("cpu", **{"bitwise": True, **options})


def test_a_tensor_parallel_mirrored_mesh_is_refused_before_any_process_group():
    info = ProcessInfo(rank=0, world_size=4, local_rank=0, local_world_size=4)
    with pytest.raises(ValueError, match=r"MirroredStrategy\(bitwise=True\) cannot keep this exact. Received: mesh "
                                         r"dp=2,tp=2"):
        towers.MirroredStrategy(info=info, mesh="dp=2,tp=2", bitwise=True, micro_batch_size=2)


def test_a_global_batch_the_micro_batch_does_not_divide_is_refused_before_the_first_step():
    strategy = towers.OneDeviceStrategy("cpu", bitwise=True, micro_batch_size=4)
    with pytest.raises(ValueError, match=r"Received: global_batch_size=10, micro_batch_size=4. Use a global batch that "
                                         r"is a multiple of 4, or micro_batch_size=2"):
        strategy.distribute_dataset(_data(), 10)


def test_without_a_micro_batch_size_one_is_chosen_from_the_first_global_batch():
    for global_batch, chosen in ((48, 4), (40, 5), (10, 5), (7, 1)):  # a twelfth, else an eighth, ..., else 1
        strategy = towers.OneDeviceStrategy("cpu", bitwise=True)
        strategy.distribute_dataset(_data(), global_batch)
        assert strategy._bitwise.micro_batch_size == chosen, global_batch
    plain, _ = _loop(towers.OneDeviceStrategy("cpu"))
    chosen, _ = _loop(towers.strategy_from_env(bitwise=True))  # B = 8: micro-batches of 1
    for a, b in zip(chosen.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_shares_are_whole_micro_batches_and_equal_ones_where_they_divide():
    assert [shard_bounds(48, 3, r, 4) for r in range(3)] == [shard_bounds(48, 3, r) for r in range(3)]
    assert [shard_bounds(37, 3, r, 4) for r in range(3)] == [(0, 16), (16, 28), (28, 37)]  # 10 micro-batches: 4, 3, 3
    assert [shard_bounds(5, 3, r, 4) for r in range(3)] == [(0, 4), (4, 5), (5, 5)]  # the last replica has none


def test_an_uneven_last_batch_and_gradient_accumulation_keep_the_plain_loops_maths():
    for options in ({"drop_remainder": False, "examples": 41, "steps": 6},  # 41 = 4 x 8 + 9: the last batch 2+2+2+2+1
                    {"drop_remainder": False, "examples": 41, "steps": 6, "accumulation": 2},
                    {"steps": 4, "manual_accumulation": True}):  # two runs, then step and zero_grad outside: a habit
        accumulation = options.pop("accumulation", 1)
        bitwise, losses = _loop(towers.OneDeviceStrategy("cpu", bitwise=True, micro_batch_size=2,
                                                         gradient_accumulation_steps=accumulation), **options)
        plain, plain_losses = _loop(towers.OneDeviceStrategy("cpu", gradient_accumulation_steps=accumulation), **options)
        assert len(losses) == options["steps"]
        for a, b in zip(bitwise.parameters(), plain.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.stack(losses), torch.stack(plain_losses), rtol=1e-5, atol=1e-6)


def test_an_op_without_a_deterministic_kernel_is_named_at_the_first_step():
    class GPUScatter(nn.Module):  # raises as a CUDA kernel without a deterministic version does, in deterministic mode
        def forward(self, x):
            if torch.are_deterministic_algorithms_enabled():
                raise RuntimeError("scatter_add_cuda_kernel does not have a deterministic implementation, but you set "
                                   "'torch.use_deterministic_algorithms(True)'.")
            return x

    strategy = towers.OneDeviceStrategy("cpu", bitwise=True, micro_batch_size=2)
    assert torch.are_deterministic_algorithms_enabled()  # bitwise=True asks for the same bits every run
    model, optimizer = strategy.prepare(nn.Sequential(GPUScatter(), nn.Linear(6, 3)), None)
    x, y = next(iter(strategy.distribute_dataset(_data(), 8, shuffle=False)))
    with pytest.raises(ValueError, match=r"an op of the step has no deterministic kernel on this device. Received: "
                                         r"scatter_add_cuda_kernel. Replace that op"):
        strategy.run(lambda a, b: F.cross_entropy(model(a), b), args=(x, y))


def test_a_loop_without_strategy_run_is_refused():
    strategy = towers.OneDeviceStrategy("cpu", bitwise=True, micro_batch_size=2)
    model, _ = strategy.prepare(nn.Linear(6, 3), None)
    x, _ = next(iter(strategy.distribute_dataset(_data(), 8, shuffle=False)))
    with pytest.raises(ValueError, match=r"bitwise=True runs each step through strategy.run"):
        model(x)


def test_two_backwards_in_a_micro_batch_and_a_tuple_result_are_refused():
    def twice(model, optimizer):
        def step(x, y):
            for _ in range(2):
                towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
            optimizer.step()
        return step

    with pytest.raises(ValueError, match=r"one backward's. Received: a second backward"):
        _loop(towers.OneDeviceStrategy("cpu", bitwise=True, micro_batch_size=2), step_fn=twice)

    def pair(model, optimizer):
        def step(x, y):
            logits = model(x)
            towers.compute_average_loss(F.cross_entropy(logits, y, reduction="none")).backward()
            optimizer.step()
            return logits.sum(), logits
        return step

    with pytest.raises(ValueError, match=r"a tuple of those, or nothing. Received: a tuple"):
        _loop(towers.OneDeviceStrategy("cpu", bitwise=True, micro_batch_size=2), step_fn=pair)


@pytest.mark.parametrize("options, match", [
    ({"shard": True, "group_size": 2, "group_rank": 0, "group_port": 29999}, r"Received: shard=True: FSDP2"),
    ({"group_size": 2, "group_rank": 0, "group_port": 29999}, r"Received: group_size=2: a group's processes"),
])
def test_fault_tolerant_bitwise_refuses_groups_of_several_processes_before_connecting(options, match):
    pytest.importorskip("torchft", reason="the optional extra towers[ft] is not installed")
    info = ProcessInfo(rank=0, world_size=4, local_rank=0, local_world_size=4)
    with pytest.raises(ValueError, match=r"FaultTolerantStrategy\(bitwise=True\) cannot keep this exact. " + match):
        towers.FaultTolerantStrategy(info=info, lighthouse="http://127.0.0.1:1", bitwise=True, **options)


@pytest.mark.parametrize("options, match", [
    ({"mode": "async"}, r"Received: mode='async': each update there is one worker's share"),
    ({"mode": "diloco", "sync_every": 4}, r"Received: mode='diloco': each update there is one worker's share"),
])
def test_the_parameter_servers_refuse_what_is_not_one_devices_update_before_connecting(options, match):
    with pytest.raises(ValueError, match=r"ParameterServerStrategy\(bitwise=True\) cannot keep this exact. " + match):
        towers.ParameterServerStrategy(bitwise=True, **options)


def test_a_ps_round_sums_the_workers_subtrees_in_one_devices_order_whatever_order_they_arrive_in():
    from towers.strategies._bitwise_tree import Grads, root_sum
    from towers.strategies.parameter_server.requests import RequestError
    from towers.strategies.parameter_server.sharding import FlatLayout, ParamSpec
    from towers.strategies.parameter_server.tree_round import TreeRound

    layout = FlatLayout([ParamSpec("w", (3, 5), "torch.float32"), ParamSpec("b", (7,), "torch.float32")])
    torch.manual_seed(0)
    leaves = {(0, i): Grads([torch.randn(3, 5) * 10 ** (i - 3), torch.randn(7)]) for i in range(6)}
    zeros = lambda: Grads([torch.zeros(3, 5), torch.zeros(7)])  # noqa: E731
    one_device = root_sum(leaves, 6, zeros)

    def push(first: int, end: int) -> tuple[dict, torch.Tensor]:  # a worker's subtrees, one row of the layout each
        nodes = dyadic_nodes(first, end)
        rows = torch.zeros(len(nodes) * layout.nbytes, dtype=torch.uint8)
        for k, node in enumerate(nodes):
            for view, value in zip(layout.views(rows[k * layout.nbytes:(k + 1) * layout.nbytes]),
                                   tree_sum(leaves, *node, 6, zeros).tensors):
                view.copy_(value)
        return {"nodes": [list(n) for n in nodes], "leaves": 6}, rows

    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):  # 3 workers of 2 micro-batches each, arriving in any order
        tree, out = TreeRound(0), layout.new_buffer()
        for w in order:
            tree.add(f"worker {w}", *push(*shard_bounds(6, 3, w)), layout.nbytes)
        tree.total_into(layout, out)
        assert all(torch.equal(a, b) for a, b in zip(layout.views(out), one_device.tensors)), order
        assert not tree.active  # the next round starts empty
    tree = TreeRound(0)
    meta, rows = push(0, 2)
    tree.add("worker 0", meta, rows, layout.nbytes)
    with pytest.raises(RequestError, match=r"worker 0 pushed tree node \(1, 0\) twice in one round"):
        tree.add("worker 0", meta, rows, layout.nbytes)
    with pytest.raises(RequestError, match=r"worker 1 pushed a tree over 8 micro-batches into a round over 6"):
        tree.add("worker 1", {**push(2, 4)[0], "leaves": 8}, push(2, 4)[1], layout.nbytes)
    with pytest.raises(RequestError, match=r"worker 1's bitwise push carries 0 B for 1 subtree"):
        tree.add("worker 1", push(2, 4)[0], None, layout.nbytes)
    with pytest.raises(RequestError, match=r"worker 1 sent a malformed bitwise push"):
        tree.add("worker 1", {"nodes": "all"}, None, layout.nbytes)
    with pytest.raises(RequestError, match=r"the round's tree is incomplete \(bitwise: leaf 2 of 6 is missing"):
        tree.total_into(layout, layout.new_buffer())  # a worker lost: its micro-batches are in no one's tree


@pytest.mark.parametrize("options, match", [
    ({"mesh": "dp=2,tp=2"}, r"Received: mesh dp_shard=2,tp=2: only plain sharding"),
    ({"mesh": "dp_replicate=2,dp_shard=2"}, r"Received: mesh .*dp_replicate=2.*only plain sharding"),
    ({"cpu_offload": True}, r"Received: cpu_offload=True: the gradients leave the device"),
])
def test_sharded_bitwise_refuses_what_its_tree_cannot_cover_before_any_process_group(options, match):
    info = ProcessInfo(rank=0, world_size=4, local_rank=0, local_world_size=4)
    with pytest.raises(ValueError, match=r"FullyShardedStrategy\(bitwise=True\) cannot keep this exact. " + match):
        towers.FullyShardedStrategy(info=info, bitwise=True, micro_batch_size=2, **options)


def test_the_strategy_option_reaches_the_strategies_that_take_it():
    from towers.strategies.registry import check_strategy_options

    check_strategy_options("mirrored", {"bitwise": "true", "micro_batch_size": 4})
    check_strategy_options("ps", {"bitwise": "true", "micro_batch_size": 4, "mode": "sync"})
    check_strategy_options("hybrid", {"bitwise": "true", "micro_batch_size": 4})
    with pytest.raises(ValueError, match=r"takes micro_batch_size as an integer"):
        check_strategy_options("mirrored", {"bitwise": "true", "micro_batch_size": "four"})


def test_towers_verify_bitwise_refuses_what_it_cannot_compare(tmp_path):
    from towers.verify import VerifySpec

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    with pytest.raises(ValueError, match=r"--bitwise compares the strategies that train bit for bit. Received: "
                                         r"--strategies ps"):
        VerifySpec(script=str(script), strategies=("ps",), bitwise=4)
    assert VerifySpec(script=str(script), strategies=("mirrored", "sharded"), bitwise=4).bitwise == 4
    with pytest.raises(ValueError, match=r"a plain script has no towers strategy"):
        VerifySpec(script=str(script), plain=True, bitwise=4)
    with pytest.raises(ValueError, match=r"--bitwise takes the micro-batch size .* Received: 0"):
        VerifySpec(script=str(script), strategies=("mirrored",), bitwise=0)
    assert VerifySpec(script=str(script), strategies=("mirrored",), bitwise=4).bitwise == 4
