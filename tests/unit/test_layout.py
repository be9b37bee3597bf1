"""The layout rules of docs/architecture.md, checked on the source: small modules, launch/ below strategies/, each
strategy family in its own room, and no module reading another's private names."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "towers"
#: Lines of a module besides its docstrings (which are the API reference): past this it is two concepts.
MAX_LINES = 330
FAMILIES = ("towers.strategies.parameter_server", "towers.strategies.fault_tolerant", "towers.strategies.hybrid")
#: A capability is an object a class holds, not a base class in another file: no class's chain of towers base
#: classes spans more files than this.
MAX_CHAIN_FILES = 3
#: Classes the two composition tests below leave out (none: every class keeps both rules).
PENDING: set[str] = set()


def _modules() -> list[tuple[str, ast.Module, int]]:
    """Every module, its tree, and its length in lines not counting docstrings (the API reference is built from them:
    documenting a function well must not push its module over the limit; the code's size is the concept's)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        documented = [node.body[0] for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str)]
        docstrings = sum((d.end_lineno or d.lineno) - d.lineno + 1 for d in documented)
        found.append((str(path.relative_to(SRC.parent)), tree, len(text.splitlines()) - docstrings))
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


def test_no_module_is_over_the_line_cap():
    long = {path: n for path, _, n in _modules() if n > MAX_LINES}
    assert long == {}, f"split these modules (one concept each, <= {MAX_LINES} lines besides docstrings): {long}"


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


def _towers_classes() -> list[type]:
    """Every class defined in a towers module (each once), after importing every towers module."""
    import towers

    classes: dict[int, type] = {}
    for info in pkgutil.walk_packages(towers.__path__, "towers."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__.split(".")[0] == "towers":
                classes[id(value)] = value
    return list(classes.values())


def test_no_class_chain_spans_more_than_three_files():
    """A class holds its capabilities as objects: the towers classes in its ``__mro__`` come from <= 3 source files."""
    import sys

    found = {}
    for cls in _towers_classes():
        if cls.__name__ in PENDING:
            continue
        files = list(dict.fromkeys(str(Path(sys.modules[c.__module__].__file__ or "").relative_to(SRC.parent))
                                   for c in cls.__mro__ if c.__module__.split(".")[0] == "towers"))
        if len(files) > MAX_CHAIN_FILES:
            found[f"{cls.__module__}.{cls.__qualname__}"] = files
    assert found == {}, f"these classes are cut into base classes across files; hold the parts as objects: {found}"


def _class_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a class body, those under ``if``/``try`` included (not those of its methods or nested classes)."""
    out: list[ast.stmt] = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, ast.If):
            out += _class_statements(stmt.body) + _class_statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            out += _class_statements(stmt.body + stmt.orelse + stmt.finalbody)
    return out


def _declares_fields(cls: ast.ClassDef) -> bool:
    """A dataclass, NamedTuple, TypedDict or Protocol: its bare annotations are fields or an interface, set by its own
    ``__init__`` (or nobody's), not state for another file to set."""
    names = {ast.unparse(d.func if isinstance(d, ast.Call) else d).rsplit(".", 1)[-1] for d in cls.decorator_list}
    bases = {ast.unparse(b).rsplit(".", 1)[-1].split("[")[0] for b in cls.bases}
    return "dataclass" in names or bool(bases & {"NamedTuple", "TypedDict", "Protocol"})


def _self_attributes_assigned(tree: ast.Module) -> set[str]:
    """The names ``x`` of every ``self.x = ...`` (plain, annotated, augmented or unpacked) in ``tree``."""
    targets: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets += node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets.append(node.target)
    names = set()
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets += target.elts
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            names.add(target.attr)
    return names


def test_no_base_class_declares_private_attributes_for_other_files():
    """A private attribute is declared where it is set: a bare class-level annotation (``_x: T``, no value) is
    flagged unless the same file assigns ``self._x``; a class whose state another file sets is a base class cut
    out of that file (hold it as an object, handed what it needs)."""
    found = []
    for path, tree, _ in _modules():
        assigned = _self_attributes_assigned(tree)
        for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
            if cls.name in PENDING or _declares_fields(cls):
                continue
            for stmt in _class_statements(cls.body):
                if (isinstance(stmt, ast.AnnAssign) and stmt.value is None and isinstance(stmt.target, ast.Name)
                        and stmt.target.id.startswith("_") and not stmt.target.id.startswith("__")
                        and stmt.target.id not in assigned):
                    found.append(f"{path}:{stmt.lineno} {cls.name}.{stmt.target.id}")
    assert found == [], f"private attributes declared bare for another file to set: {found}"
