"""Library log lines carry [rank r/w]; only the chief logs INFO unless asked otherwise."""

from __future__ import annotations

import logging

import pytest

from towers import _logging


@pytest.fixture
def captured():
    logger = _logging.get_logger("towers.test_logging")
    root = logging.getLogger("towers")
    handler = root.handlers[0]
    records: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record):
            records.append(handler.format(record))

    extra = ListHandler()
    for f in handler.filters:
        extra.addFilter(f)
    root.addHandler(extra)
    yield logger, records
    root.removeHandler(extra)
    _logging.set_rank(0, 1)
    _logging.all_ranks_log(False)


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
