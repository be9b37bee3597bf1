"""user_error: what was wrong, the value received, and what to do, in one line."""

from __future__ import annotations

import pytest

from towers.cluster.base import ClusterConfigError
from towers.errors import user_error


def test_the_message_has_what_received_and_fix():
    err = user_error("global_batch_size must be positive.", 0, "Use e.g. 64.")
    assert isinstance(err, ValueError) and str(err) == "global_batch_size must be positive. Received: 0. Use e.g. 64."
    assert str(user_error("bad name", "'x'", "Rename it.")) == "bad name. Received: 'x'. Rename it."


def test_the_class_is_chosen_and_long_values_are_cut():
    err = user_error("TF_CONFIG is wrong", "y" * 1000, "Fix it.", cls=ClusterConfigError)
    assert isinstance(err, ClusterConfigError) and len(str(err)) < 400 and "..." in str(err)
    with pytest.raises(RuntimeError, match="Received: None"):
        raise user_error("no optimizer", None, "Pass one.", cls=RuntimeError)
