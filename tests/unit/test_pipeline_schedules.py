"""Pipeline schedules without processes: the seven names, which stages each process holds, fallbacks, the bubble.

What runs on processes (each schedule against the plain one-device loop) is
tests/distributed/test_pipeline_schedules.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from towers.models_gpt import GPT, GPTConfig
from towers.parallel.pipeline_schedules import (
    SCHEDULES,
    bubble_fraction,
    check_schedule,
    runnable_schedule,
    schedule_actions,
    schedule_spec,
)
from towers.parallel.pipeline_split import StageView, split_model

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


def test_every_schedule_torch_ships_is_a_pp_schedule_by_name():
    from torch.distributed.pipelining import schedules

    assert SCHEDULES == ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble",
                         "dualpipe_v")
    for name in SCHEDULES:
        assert check_schedule(name.upper()) == name
        assert isinstance(getattr(schedules, schedule_spec(name).torch_name), type)
    # torch's own spellings (get_schedule_class's keys) name them too
    assert [check_schedule(n) for n in ("ZBVZeroBubble", "DualPipeV", "Interleaved1F1B", "LoopedBFS",
                                        "InterleavedZeroBubble", "GPipe", "dualpipe-v")] == [
        "zbv_zero_bubble", "dualpipe_v", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "gpipe",
        "dualpipe_v"]


def test_a_bad_name_is_refused_listing_the_seven():
    with pytest.raises(ValueError, match=r"pp_schedule names a pipeline schedule towers runs. Received: 'zb'. Use one "
                                         r"of '1f1b', 'gpipe', 'interleaved_1f1b', 'looped_bfs', "
                                         r"'interleaved_zero_bubble', 'zbv_zero_bubble', 'dualpipe_v'"):
        check_schedule("zb")


@pytest.mark.parametrize("pp", [2, 4])
def test_which_stages_each_process_holds(pp):
    for name in SCHEDULES:
        spec = schedule_spec(name)
        held = [spec.stages_of(r, pp) for r in range(pp)]
        assert sorted(s for stages in held for s in stages) == list(range(spec.num_stages(pp)))  # each stage once
        assert all(spec.rank_of(s, pp) == r for r, stages in enumerate(held) for s in stages)
    assert schedule_spec("1f1b").stages_of(1, pp) == [1]
    assert schedule_spec("interleaved_1f1b").stages_of(1, pp) == [1, 1 + pp]  # looped
    assert schedule_spec("dualpipe_v").stages_of(1, pp) == [1, 2 * pp - 2]  # a V
    assert schedule_spec("zbv_zero_bubble").rank_of(2 * pp - 1, pp) == 0  # a V's last stage is on process 0


def test_a_count_a_schedule_cannot_run_falls_back_to_one_with_the_same_stages():
    assert runnable_schedule("1f1b", 4, 2) == ("1f1b", None)
    assert runnable_schedule("1f1b", 1, 2) == ("gpipe", "1F1B needs at least as many micro-batches as stages (2)")
    assert runnable_schedule("dualpipe_v", 3, 2) == (
        "zbv_zero_bubble", "DualPipeV needs at least as many micro-batches as stages (4)")
    assert runnable_schedule("interleaved_1f1b", 5, 2)[0] == "looped_bfs"
    assert runnable_schedule("interleaved_zero_bubble", 7, 2)[0] == "looped_bfs"
    assert runnable_schedule("interleaved_1f1b", 6, 2) == ("interleaved_1f1b", None)
    for name in ("gpipe", "looped_bfs", "zbv_zero_bubble"):  # these run any count
        assert all(runnable_schedule(name, n, 4) == (name, None) for n in range(1, 10))
    with pytest.raises(ValueError, match=r"pp_schedule='dualpipe_v' on pp=2 cannot run this many micro-batches.*"
                                         r"Received: 3 micro-batch\(es\)"):
        schedule_actions("dualpipe_v", 2, 3)


@pytest.mark.parametrize("pp, n", [(2, 1), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16)])
def test_the_bubble_of_1f1b_and_gpipe_is_the_textbook_one(pp, n):
    for name in ("1f1b", "gpipe"):
        if runnable_schedule(name, n, pp)[1] is None:
            assert bubble_fraction(schedule_actions(name, pp, n), pp) == pytest.approx((pp - 1) / (n + pp - 1))


@pytest.mark.parametrize("pp, n", [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_two_stages_per_process_shrink_the_bubble_and_zero_bubble_more(pp, n):
    def bubble(name: str) -> float:
        return bubble_fraction(schedule_actions(name, pp, n), schedule_spec(name).num_stages(pp))

    # Interleaving v = 2 stages per process: (pp - 1) / (v * n + pp - 1)
    assert bubble("interleaved_1f1b") == pytest.approx((pp - 1) / (2 * n + pp - 1))
    assert bubble("interleaved_zero_bubble") < bubble("interleaved_1f1b") < bubble("1f1b")
    assert bubble("zbv_zero_bubble") < bubble("1f1b")
    if n >= 2 * pp:  # DualPipeV needs a micro-batch per stage
        assert 0 < bubble("dualpipe_v") < bubble("1f1b")


def test_the_bubble_is_the_idle_slots_over_all_slots():
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    f, b = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    # 2 stages, 1 micro-batch: rank 0 F(1) . . . B(2) = busy 3 of 6; rank 1 . F(1) B(2) . = busy 3 of 6.
    actions = {0: [_Action(0, f, 0), _Action(0, b, 0)], 1: [_Action(1, f, 0), _Action(1, b, 0)]}
    assert bubble_fraction(actions, 2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="wait for each other"):  # a backward before its own forward: never runs
        bubble_fraction({0: [_Action(0, b, 0), _Action(0, f, 0)], 1: [_Action(1, f, 0), _Action(1, b, 0)]}, 2)


def test_two_stages_per_process_keep_the_original_names_and_chain_into_the_whole_model():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    first, second = split_model(model, [0, 2], 4), split_model(model, [1, 3], 4)  # looped: stages r and r + pp
    assert first.stage_indices == [0, 2] and first.is_first and not first.is_last and second.is_last
    assert first.module_names == ["wte", "wpe", "blocks.0", "blocks.2"]
    assert second.module_names == ["blocks.1", "blocks.3", "ln_f", "head"]
    names = {n for n, _ in model.named_parameters()}
    assert {n for n, _ in first.named_parameters()} | {n for n, _ in second.named_parameters()} == names
    views = [StageView(first, 0), StageView(second, 1), StageView(first, 2), StageView(second, 3)]
    assert {id(p) for p in views[2].parameters()} == {id(p) for p in model.blocks[2].parameters()}  # that stage's only
    first.in_schedule = second.in_schedule = True  # as the schedule runs them
    x = torch.randint(0, CONFIG.vocab_size, (3, CONFIG.block_size))
    out = x
    for view in views:
        out = view(out)
    torch.testing.assert_close(out, model(x))


def test_a_v_puts_the_first_and_last_stage_on_one_process():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    outer = split_model(model, [0, 3], 4)
    assert outer.is_first and outer.is_last and outer.module_names == ["0", "3"]


def test_too_few_blocks_for_two_stages_per_process_names_the_schedules_that_fit():
    with pytest.raises(ValueError, match=r"Each of the 8 pipeline stages \(pp=4, 2 per process\) needs at least one of "
                                         r"the model's blocks. Received: 4 blocks for 8 stages. Use pp=2 or fewer, a "
                                         r"schedule with one stage per process"):
        split_model(GPT(CONFIG), [0, 4], 8)
    with pytest.raises(ValueError, match=r"3 module name\(s\) for 4 stages \(pp=2, 2 per process\)"):
        split_model(GPT(CONFIG), [0, 2], 4, ["blocks.2"])
