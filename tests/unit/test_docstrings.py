"""Every public name has a docstring: the API reference is built from them (docs/api/), so a name without one is a
hole in the site. Public: the names in ``__all__`` of towers and its public subpackages, and the public methods and
properties of their classes (a method overriding a documented one inherits its docstring, as ``help()`` shows it).

The public functions and classes document their contract in one style, Google's (``Args:``, ``Returns:``,
``Raises:``, ``Example:``), which mkdocstrings renders as the tables of the API reference (mkdocs.yml:
``docstring_style: google``): a function that takes arguments has ``Args:``, one that returns something ``Returns:``
(or ``Yields:``), a class that takes arguments has ``Args:`` (or ``Attributes:`` for a record of fields) in its own
docstring or its ``__init__``'s."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
import subprocess
import sys
import textwrap

import pytest

from cli_support import clean_env

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


def _public_callables() -> dict[str, object]:
    """Each public function and class once, by the name a user imports it by first."""
    found: dict[int, tuple[str, object]] = {}
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        for public in getattr(module, "__all__", ()):
            obj = getattr(module, public, None)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                found.setdefault(id(obj), (f"{name}.{public}", obj))
    return dict(found.values())


def _has_section(doc: str, *names: str) -> bool:
    return any(re.search(rf"^\s*{name}:\s*$", doc, flags=re.MULTILINE) for name in names)


def _arguments(function: object, *, method: bool) -> tuple[list[str], object]:
    """The arguments a user passes (not self, not a bare *args/**kwargs) and the return annotation."""
    try:
        signature = inspect.signature(function)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return [], inspect.Signature.empty
    parameters = [p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if method and parameters and parameters[0].name in ("self", "cls"):
        parameters = parameters[1:]
    return [p.name for p in parameters], signature.return_annotation


def _lacking_sections() -> list[str]:
    lacking = []
    for name, obj in sorted(_public_callables().items()):
        doc = inspect.getdoc(obj) or ""
        missing = []
        if inspect.isfunction(obj):
            arguments, returns = _arguments(obj, method=False)
            if arguments and not _has_section(doc, "Args"):
                missing.append("Args")
            if returns not in (inspect.Signature.empty, None, "None") and not _has_section(doc, "Returns", "Yields"):
                missing.append("Returns")
        else:
            assert inspect.isclass(obj)
            init = obj.__init__
            inherited = init is object.__init__ or (issubclass(obj, BaseException) and init is BaseException.__init__)
            arguments = [] if inherited else _arguments(init, method=True)[0]
            init_doc = (inspect.getdoc(init) or "") if "__init__" in vars(obj) else ""
            if arguments and not (_has_section(doc, "Args", "Attributes") or _has_section(init_doc, "Args")):
                missing.append("Args")
        if missing:
            lacking.append(f"{name} ({', '.join(missing)})")
    return lacking


@pytest.mark.timeout(120)
def test_public_callables_document_their_arguments_and_results():
    lacking = _lacking_sections()
    assert lacking == [], (f"{len(lacking)} public names lack a Google-style section (Args: for what they take, "
                           f"Returns: for what they give back):\n" + "\n".join(lacking))


_OTHER_STYLES = re.compile(r"^\s*(Parameters|Returns|Raises|Examples?|Attributes)\s*\n\s*-{3,}\s*$"
                           r"|^\s*:(param|returns?|raises)\b", flags=re.MULTILINE)


def test_public_docstrings_use_one_style():
    """NumPy-style underlined sections or reST fields would render as plain text: the site parses Google style."""
    other = [name for name, obj in sorted(_public_callables().items()) if _OTHER_STYLES.search(inspect.getdoc(obj) or "")]
    assert other == [], f"write these docstrings in Google style (Args:, Returns:, Raises:, Example:): {other}"


_EXAMPLE = re.compile(r"(<!-- not-run: (?P<reason>[^>]*?) -->\s*)?^(?P<indent>[ ]*)```python\n(?P<code>.*?)^(?P=indent)```",
                      flags=re.MULTILINE | re.DOTALL)

_EXAMPLE_RUNNER = r"""
import json, sys, traceback
failed = []
for name, code in json.load(open(sys.argv[1])):
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    except BaseException:
        failed.append(f"{name}:\n{traceback.format_exc()}")
print("\n".join(failed), file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def _docstring_examples() -> list[tuple[str, str, str | None]]:
    """``(name, code, not-run reason or None)`` for each ```python block in a public name's docstring."""
    found = []
    for name, obj in sorted(_public_callables().items()):
        for match in _EXAMPLE.finditer(inspect.getdoc(obj) or ""):
            code = textwrap.dedent(match.group("code"))
            found.append((f"{name} (docstring example)", code, match.group("reason")))
    return found


@pytest.mark.timeout(240)
def test_docstring_examples_run_as_written(tmp_path):
    """The API reference shows the ``Example:`` blocks of the docstrings: they run, at one process, as written (or say
    ``<!-- not-run: REASON -->`` before the fence, hidden on the site)."""
    examples = _docstring_examples()
    assert len(examples) >= 10, f"the main entry points lost their examples: {[name for name, _, _ in examples]}"
    assert all(reason is None or reason.strip() for _, _, reason in examples), "<!-- not-run: REASON --> needs a reason"
    runnable = [(name, code) for name, code, reason in examples if reason is None]
    (tmp_path / "examples.json").write_text(json.dumps(runnable))
    (tmp_path / "runner.py").write_text(_EXAMPLE_RUNNER)
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "examples.json")], cwd=work,
                          env=clean_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, f"docstring examples that fail:\n{done.stderr[-8000:]}"


# The classes a user calls most: their own public methods document arguments and results too (the subclasses'
# overrides inherit the contract, and their docstrings say what differs).
_MAIN_CLASSES = ("towers.Strategy", "towers.Trainer", "towers.checkpoint.CheckpointManager")


def test_the_main_classes_methods_document_their_arguments_and_results():
    lacking = []
    for path in _MAIN_CLASSES:
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        for attr, value in vars(cls).items():
            function = getattr(value, "__func__", value)
            if attr.startswith("_") or not inspect.isfunction(function):
                continue
            doc = inspect.getdoc(function) or ""
            arguments, returns = _arguments(inspect.unwrap(function), method=True)
            missing = [section for section, needed in (
                ("Args", arguments and not _has_section(doc, "Args")),
                ("Returns", returns not in (inspect.Signature.empty, None, "None")
                 and not _has_section(doc, "Returns", "Yields"))) if needed]
            if missing:
                lacking.append(f"{path}.{attr} ({', '.join(missing)})")
    assert lacking == [], "document these methods in Google style:\n" + "\n".join(lacking)
