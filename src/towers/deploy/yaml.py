"""A tiny YAML writer for manifests: dicts, lists, strings, numbers, booleans, None. No PyYAML needed.

Strings that YAML could read as something else (``"yes"``, ``"1.0"``, ``"a: b"``, ...) are written
as JSON strings, which are valid YAML double-quoted scalars.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

__all__ = ["to_yaml", "to_yaml_documents"]

_PLAIN = re.compile(r"^[A-Za-z_/.][A-Za-z0-9_./-]*$")
_RESERVED = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in _RESERVED:
        return text
    return json.dumps(text)


def _lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return [pad + "{}"]
        out = []
        for key, item in value.items():
            head = f"{pad}{_scalar(str(key))}:"
            if isinstance(item, (dict, list)) and item:
                out.append(head)
                out.extend(_lines(item, indent + 2 if isinstance(item, dict) else indent))
            else:
                out.append(f"{head} {_lines(item, 0)[0]}")
        return out
    if isinstance(value, (list, tuple)):
        if not value:
            return [pad + "[]"]
        out = []
        for item in value:
            inner = _lines(item, indent + 2)
            # "- " replaces the first two spaces of the item's first line.
            out.append(f"{pad}- {inner[0][indent + 2:]}")
            out.extend(inner[1:])
        return out
    return [pad + _scalar(value)]


def to_yaml(document: Any) -> str:
    """Return ``document`` (plain dicts/lists/scalars) as block-style YAML text."""
    return "\n".join(_lines(document, 0)) + "\n"


def to_yaml_documents(documents: Iterable[Any]) -> str:
    """Return several documents as one multi-document YAML stream (``---`` between them)."""
    return "---\n".join(to_yaml(d) for d in documents)
