"""The host limits ``towers launch`` checks on the store's node: raised where it can, named where it cannot."""

from __future__ import annotations

from towers.launch.limits import SPARE_FILES, HostLimits, check_host_limits, read_limits


def test_a_small_job_on_ordinary_limits_says_nothing():
    assert check_host_limits(8, limits=HostLimits(1024 + 8, 4096, 4096)) == []


def test_the_soft_file_limit_is_raised_to_what_the_job_needs_when_the_hard_limit_allows():
    raised = []
    limits = HostLimits(1024, 1 << 20, 65535)
    assert check_host_limits(16384, limits=limits, raise_soft=raised.append) == []
    assert raised == [16384 + SPARE_FILES] and limits.files_soft == 16384 + SPARE_FILES


def test_limits_that_cannot_be_raised_are_named_with_the_numbers_and_the_fix():
    raised = []
    warnings = check_host_limits(16384, limits=HostLimits(1024, 4096, 128), raise_soft=raised.append)
    assert raised == [4096]  # as far as the hard limit goes
    files, backlog = warnings
    assert "16384 processes" in files and "open-file limit is 4096 (hard 4096)" in files
    assert f"ulimit -n {16384 + SPARE_FILES}" in files
    assert "net.core.somaxconn is 128" in backlog and "sysctl -w net.core.somaxconn=16384" in backlog


def test_this_hosts_limits_are_read():
    limits = read_limits()
    assert 0 < limits.files_soft <= limits.files_hard
    assert limits.somaxconn is None or limits.somaxconn > 0
    assert read_limits("/nonexistent/somaxconn").somaxconn is None
