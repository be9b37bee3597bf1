"""Every public name has a docstring: the API reference is built from them (docs/api/), so a name without one is a
hole in the site. Public: the names in ``__all__`` of towers and its public subpackages, and the public methods and
properties of their classes (a method overriding a documented one inherits its docstring, as ``help()`` shows it)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest

PUBLIC_MODULES = ("towers", "towers.data", "towers.streams", "towers.parallel", "towers.checkpoint", "towers.callbacks",
                  "towers.metrics", "towers.losses", "towers.devices", "towers.cluster", "towers.strategies",
                  "towers.training", "towers.ledger", "towers.verify", "towers.plan", "towers.errors")


def _documented(cls: type, attr: str) -> bool:
    """Whether ``cls.attr`` or the same name on a base class has a docstring."""
    for klass in cls.__mro__:
        value = vars(klass).get(attr)
        if value is None:
            continue
        target = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if (getattr(target, "__doc__", None) or "").strip():
            return True
    return False


def _undocumented() -> list[str]:
    missing = set()
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        for public in getattr(module, "__all__", ()):
            obj = getattr(module, public, None)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if not (obj.__doc__ or "").strip():
                missing.add(f"{name}.{public}")
            if inspect.isclass(obj) and obj.__module__.startswith("towers"):
                fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
                for attr, value in vars(obj).items():
                    if attr.startswith("_") or attr in fields or not (inspect.isfunction(value)
                                                                      or isinstance(value, property)):
                        continue
                    if not _documented(obj, attr):
                        missing.add(f"{obj.__module__}.{obj.__qualname__}.{attr}")
    return sorted(missing)


@pytest.mark.timeout(120)
def test_every_public_name_has_a_docstring():
    assert _undocumented() == [], "write a docstring (what it does or returns, its arguments, what it raises) for these"
