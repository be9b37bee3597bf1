"""Boolean options are read by one strict parser: True, False or the words true/false; anything else is refused,
never read as True. From the command line (checked before any process starts) and in code alike."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

import towers
from towers.cluster import roles
from towers.cluster.info import ProcessInfo
from towers.cluster.strategy_options import parse_flag, parse_strategy_options
from towers.strategies.registry import check_strategy_options, get_strategy


@pytest.mark.parametrize("given, read", [(True, True), (False, False), ("true", True), ("False", False),
                                         (" TRUE ", True)])
def test_true_false_and_their_words_are_read(given, read):
    assert parse_flag("cpu_offload", given) is read


@pytest.mark.parametrize("given", ["perhaps", "maybe", "yes", "1", "", 1, 0, 2.0, None, [True]])
def test_anything_else_is_refused_naming_the_option_and_the_value(given):
    with pytest.raises(ValueError, match=rf"cpu_offload must be True or False. Received: {re.escape(repr(given))}"):
        parse_flag("cpu_offload", given)


def _boolean_options() -> list[tuple[str, str]]:
    found = []
    for name in roles.strategy_names():
        module, _, attr = roles.strategy_entry(name).target.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        found += [(name, p.name) for p in inspect.signature(factory).parameters.values() if p.annotation == "bool"]
    return found


BOOLEAN_OPTIONS = _boolean_options()


def test_every_strategy_has_its_boolean_options_listed():
    assert {("mirrored", "find_unused_parameters"), ("mirrored", "sync_batchnorm"), ("sharded", "cpu_offload"),
            ("ps", "shared_memory"), ("fault_tolerant", "shard")} <= set(BOOLEAN_OPTIONS)


@pytest.mark.parametrize("name, option", BOOLEAN_OPTIONS, ids=[f"{n}-{o}" for n, o in BOOLEAN_OPTIONS])
def test_the_launcher_refuses_a_word_that_is_not_true_or_false(name, option):
    check_strategy_options(name, parse_strategy_options([f"{option}=true"]))
    check_strategy_options(name, parse_strategy_options([f"{option}=False"]))  # the text "False", read as False
    with pytest.raises(ValueError, match=f"{option} must be True or False. Received: 'perhaps'"):
        check_strategy_options(name, parse_strategy_options([f"{option}=perhaps"]))


@pytest.mark.parametrize("make", [
    lambda: towers.OneDeviceStrategy("cpu", sync_batchnorm="perhaps"),
    lambda: towers.MirroredStrategy(find_unused_parameters="maybe"),
    lambda: towers.MirroredStrategy(sync_batchnorm=1),
    lambda: towers.FullyShardedStrategy(info=ProcessInfo(), cpu_offload="perhaps"),
    lambda: towers.FullyShardedStrategy(info=ProcessInfo(), reshard_after_forward="no"),
    lambda: towers.ParameterServerStrategy(num_ps=1, shared_memory="perhaps"),
    lambda: towers.ParameterServerStrategy(num_ps=1, overlap="yes"),
], ids=["one_device", "mirrored-find_unused", "mirrored-sync_bn", "sharded-cpu_offload", "sharded-reshard",
        "ps-shared_memory", "ps-overlap"])
def test_a_strategy_given_a_string_refuses_it_before_anything_starts(make):
    with pytest.raises(ValueError, match="must be True or False"):
        make()


def test_the_word_false_is_false_in_code_too(caplog):
    with caplog.at_level("INFO", logger="towers.strategies.mirrored"):
        get_strategy("mirrored", info=ProcessInfo(), sync_batchnorm="false")
    assert caplog.records and not any("sync_batchnorm" in r.getMessage() for r in caplog.records)
