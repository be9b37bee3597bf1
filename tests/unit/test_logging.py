"""Library log lines carry [rank r/w]; only the chief logs INFO unless asked otherwise."""

from __future__ import annotations

import logging

import pytest

from towers import _logging


@pytest.fixture
def captured():
    import io

    logger = _logging.get_logger("towers.test_logging")
    root = logging.getLogger("towers")
    saved = (list(root.handlers), root.level, root.propagate)
    stream = io.StringIO()
    _logging.configure_logging(stream=stream)

    class Lines(list):
        def __eq__(self, other):
            return stream.getvalue().splitlines() == other

    yield logger, Lines()
    root.handlers[:], root.level, root.propagate = saved
    _logging.set_rank(0, 1)
    _logging.all_ranks_log(False)


def test_the_library_adds_only_a_null_handler_and_an_application_routes_its_lines():
    import subprocess
    import sys

    code = ("import logging, sys, towers, towers.strategies, towers.training; root = logging.getLogger('towers'); "
            "print([type(h).__name__ for h in root.handlers], root.propagate, "
            "logging.getLogger('towers.strategies').propagate); "
            "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='APP %(name)s %(message)s'); "
            "towers.OneDeviceStrategy('cpu'); logging.getLogger('towers.strategies.base').info('routed')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.splitlines()
    assert lines[0].split() == ["['NullHandler']", "True", "True"]
    assert "APP towers.strategies.base routed" in lines  # through the application's own handler


def test_lines_carry_the_rank_and_non_chief_info_is_dropped(captured):
    logger, records = captured
    _logging.set_rank(0, 2)
    logger.info("from chief")
    _logging.set_rank(1, 2)
    logger.info("from worker")
    logger.warning("worker warning")
    assert records == ["[rank 0/2] INFO towers.test_logging: from chief",
                       "[rank 1/2] WARNING towers.test_logging: worker warning"]


def test_all_ranks_log_lets_every_rank_speak(captured):
    logger, records = captured
    _logging.set_rank(1, 2)
    _logging.all_ranks_log(True)
    logger.info("hello")
    assert records == ["[rank 1/2] INFO towers.test_logging: hello"]


def test_names_outside_the_package_are_nested_under_towers():
    assert _logging.get_logger("foo").name == "towers.foo"
    assert _logging.get_logger("towers.bar").name == "towers.bar"
