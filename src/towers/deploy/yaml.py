"""YAML text for manifests, written by PyYAML's ``safe_dump``: strings stay strings.

PyYAML quotes every string that a YAML reader would resolve to another type (``"yes"``,
``"1.0"``, ``".5"``, ``".inf"``, ``".nan"``, ``"null"``, ...), so Kubernetes receives exactly the
values we rendered. Lines are never folded, and keys keep the order they were built in.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import yaml

__all__ = ["to_yaml", "to_yaml_documents"]


class _Dumper(yaml.SafeDumper):
    """``SafeDumper`` that indents list items under their key, as ``kubectl`` writes them."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


# PyYAML reads YAML 1.1; Kubernetes' reader (Go) also takes YAML 1.2's "1e3" and "0o17" as numbers.
# Marking those forms as numbers here makes the dumper quote strings that look like them.
_Dumper.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$"), list("-+.0123456789"))
_Dumper.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?(0o[0-7]+|0x[0-9a-fA-F]+|[0-9]+)$"),
                              list("-+0123456789"))


def to_yaml(document: Any) -> str:
    """Return ``document`` (plain dicts/lists/scalars) as block-style YAML text."""
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True,
                     width=2**31 - 1)


def to_yaml_documents(documents: Iterable[Any]) -> str:
    """Return several documents as one multi-document YAML stream (``---`` between them)."""
    return "---\n".join(to_yaml(d) for d in documents)
