"""The layout rules of docs/architecture.md, checked on the source: small modules, launch/ below strategies/, each
strategy family in its own room, and no module reading another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "towers"
MAX_LINES = 400
FAMILIES = ("towers.strategies.parameter_server", "towers.strategies.fault_tolerant", "towers.strategies.hybrid")


def _modules() -> list[tuple[str, ast.Module, int]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        found.append((str(path.relative_to(SRC.parent)), ast.parse(text), len(text.splitlines())))
    return found


def _imports(tree: ast.Module, module: str) -> list[tuple[str, list[str]]]:
    """``(module imported, names taken from it)`` for every import in ``tree`` (relative ones resolved)."""
    out = []
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.append((base, [a.name for a in node.names]))
    return out


def _dotted(path: str) -> str:
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def test_no_module_is_over_400_lines():
    long = {path: n for path, _, n in _modules() if n > MAX_LINES}
    assert long == {}, f"split these modules (one concept each, <= {MAX_LINES} lines): {long}"


def test_launch_never_imports_strategies():
    found = [(path, mod) for path, tree, _ in _modules() if path.startswith("towers/launch/")
             for mod, _ in _imports(tree, _dotted(path)) if mod.startswith("towers.strategies")]
    assert found == []


def test_generic_code_imports_no_strategy_family():
    """training/, the data inputs and the CLI know strategies through the Strategy interface and the registry only."""
    found = []
    for path, tree, _ in _modules():
        if path.startswith("towers/strategies/"):
            continue
        for mod, _ in _imports(tree, _dotted(path)):
            if mod.startswith(FAMILIES):
                found.append((path, mod))
    allowed = {"towers/__init__.py", "towers/callbacks.py", "towers/strategies.py"}  # the public re-exports
    assert [f for f in found if f[0] not in allowed] == []


def test_no_module_imports_another_modules_private_names():
    found = []
    for path, tree, _ in _modules():
        for mod, names in _imports(tree, _dotted(path)):
            if mod.startswith("towers") and mod != _dotted(path):
                found += [f"{path}: from {mod} import {n}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert found == []


def test_trainer_is_composed_not_cut_into_mixins():
    """The Trainer holds its parts (the epoch loop, the step runner, evaluate/predict) as objects: its chain of
    base classes is not a class cut into mixins across files."""
    import towers

    towers_bases = [c for c in towers.Trainer.__mro__[1:] if c.__module__.split(".")[0] == "towers"]
    assert len(towers_bases) <= 1, f"Trainer derives from towers classes {towers_bases}: hold them as collaborators"
