"""towers' errors: one base class (TowersError) whose subclasses are also the builtins they used to be, and
user_error: what was wrong, the value received, and what to do, in one line."""

from __future__ import annotations

import ast
import importlib
import pickle
import traceback
from pathlib import Path

import pytest

import towers
import towers.errors
from towers.cluster.base import ClusterConfigError
from towers.cluster.info import ProcessInfo
from towers.errors import TowersError, user_error

SRC = Path(towers.__file__).resolve().parent

# towers' class for each builtin it raised before it had its own classes
BUILTIN_CLASS = {
    ValueError: towers.InvalidArgumentError,
    TypeError: towers.InvalidTypeError,
    RuntimeError: towers.FailedPreconditionError,
    NotImplementedError: towers.UnimplementedError,
    FileNotFoundError: towers.NotFoundError,
    TimeoutError: towers.DeadlineExceededError,
}

# Error classes that never reach a user: a parse failure turned into one ValueError at once, and a ps task's
# refusal of a request, sent to the worker as a reply status (the worker raises a towers error).
INTERNAL = {"towers.devices.names._ParseError", "towers.strategies.parameter_server.requests.RequestError"}


def test_the_message_has_what_received_and_fix():
    err = user_error("global_batch_size must be positive.", 0, "Use e.g. 64.")
    assert isinstance(err, ValueError) and str(err) == "global_batch_size must be positive. Received: 0. Use e.g. 64."
    assert str(user_error("bad name", "'x'", "Rename it.")) == "bad name. Received: 'x'. Rename it."


def test_the_class_is_chosen_and_long_values_are_cut():
    err = user_error("TF_CONFIG is wrong", "y" * 1000, "Fix it.", cls=ClusterConfigError)
    assert isinstance(err, ClusterConfigError) and len(str(err)) < 400 and "..." in str(err)
    with pytest.raises(RuntimeError, match="Received: None"):
        raise user_error("no optimizer", None, "Pass one.", cls=RuntimeError)


@pytest.mark.parametrize("builtin, cls", BUILTIN_CLASS.items(), ids=lambda v: getattr(v, "__name__", ""))
def test_each_towers_class_is_a_towers_error_and_its_builtin_and_user_error_picks_it(builtin, cls):
    assert issubclass(cls, TowersError) and issubclass(cls, builtin)
    assert cls is getattr(towers.errors, cls.__name__) and cls.__name__ in towers.__all__
    err = user_error("x must be positive", -1, "Pass 1.", cls=builtin)
    assert type(err) is cls and str(err) == "x must be positive. Received: -1. Pass 1."
    with pytest.raises(builtin):  # what users who catch the builtin wrote keeps working
        raise err
    assert type(pickle.loads(pickle.dumps(err))) is cls  # errors travel between processes
    # a traceback names the class as users catch it
    assert traceback.format_exception_only(err)[-1] == f"towers.{cls.__name__}: {err}\n"


def test_every_class_in_towers_errors_derives_from_towers_error_and_a_builtin():
    classes = [getattr(towers.errors, name) for name in towers.errors.__all__ if isinstance(getattr(towers.errors, name), type)]
    assert set(classes) == {TowersError, *BUILTIN_CLASS.values()}
    for cls in classes:
        assert issubclass(cls, TowersError) and getattr(towers, cls.__name__) is cls
        if cls is not TowersError:
            assert any(b in BUILTIN_CLASS for b in cls.__mro__[2:]), cls


def test_user_error_keeps_a_towers_class_and_derives_nothing_for_other_classes():
    assert type(user_error("a", 1, "b.", cls=ClusterConfigError)) is ClusterConfigError
    assert type(user_error("a", 1, "b.", cls=towers.NotFoundError)) is towers.NotFoundError
    other = user_error("a", 1, "b.", cls=OSError)
    assert type(other) is OSError and not isinstance(other, TowersError)


def test_an_error_from_a_real_call_is_caught_both_ways():
    with pytest.raises(TowersError, match="rank must be in"):
        ProcessInfo(rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank must be in"):
        ProcessInfo(rank=2, world_size=2)


def _sources() -> list[tuple[str, Path, ast.Module]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append((module, path, ast.parse(path.read_text(encoding="utf-8"))))
    return out


def test_towers_raises_no_builtin_directly():
    # `raise ValueError(...)` gives an error `except towers.TowersError` misses: use the towers class (or
    # user_error). A bare `raise NotImplementedError` of an abstract method, or a `raise ValueError` with no
    # message caught right below it, is no error for a person and may stay.
    names = {cls.__name__ for cls in BUILTIN_CLASS}
    found = [f"{path.relative_to(SRC)}:{node.lineno}: {node.func.id}(...)"
             for _, path, tree in _sources() if path.name != "errors.py"
             for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names]
    assert not found, "builtins raised directly (use towers.errors' classes):\n" + "\n".join(found)


def test_every_error_class_of_towers_is_a_towers_error():
    checked, wrong = 0, []
    for module, _, tree in _sources():
        names = [node.name for node in tree.body if isinstance(node, ast.ClassDef) and node.name.endswith("Error")]
        if not names:
            continue
        loaded = importlib.import_module(module)
        for name in names:
            if f"{module}.{name}" in INTERNAL:
                continue
            checked += 1
            cls = getattr(loaded, name)
            if not issubclass(cls, TowersError):
                wrong.append(f"{module}.{name}")
    assert checked >= 20 and not wrong, f"not a TowersError: {wrong}"
