"""Strategy options chosen from outside the script: ``towers launch --strategy-option mode=async``.

The launcher turns each ``KEY=VALUE`` into one JSON object in ``TOWERS_STRATEGY_OPTIONS`` for every
worker (the manifests of ``towers k8s`` pass the same flags); ``towers.cluster.from_env`` reads it
into ``ProcessInfo.strategy_options`` and ``towers.strategy_from_env`` hands each option to the
strategy, which must take it. A value is read as JSON when it is one (``2``, ``true``, ``0.5``,
``null``), else as text (``async``). No torch here.

``parse_flag`` is the one parser of every boolean option towers takes (a strategy's, a loader's): ``True``,
``False`` or the words ``true`` / ``false``; anything else (``perhaps``, ``1``, ``yes``) is refused, never
read as True.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from towers.errors import InvalidArgumentError

__all__ = ["ENV", "parse_strategy_options", "encode_strategy_options", "decode_strategy_options", "parse_flag"]

#: The environment variable that carries the options to every worker.
ENV = "TOWERS_STRATEGY_OPTIONS"

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESERVED = ("info",)  # set by strategy_from_env itself


_WORDS = {"true": True, "false": False}


def parse_flag(name: str, value: Any) -> bool:
    """Return the boolean option ``name``'s value: ``True``/``False``, or the text ``"true"``/``"false"`` (any case).

    What ``--strategy-option KEY=true`` gives is already a bool; ``KEY=True`` arrives as the text ``"True"``.

    Raises:
        ValueError: on anything else (``"perhaps"``, ``1``, ``"yes"``, None), naming the option and the value.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _WORDS:
        return _WORDS[value.strip().lower()]
    raise InvalidArgumentError(f"{name} must be True or False. Received: {value!r}. Pass {name}=True or "
                               f"{name}=False (--strategy-option {name}=true from the command line), or leave it out.")


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_strategy_options(items: Sequence[str]) -> dict[str, Any]:
    """Return ``{key: value}`` for ``--strategy-option KEY=VALUE`` items.

    Raises:
        ValueError: on an item without ``=``, a key that is no Python name, or a key given twice.
    """
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = str(item).partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key) or key in _RESERVED:
            raise InvalidArgumentError(f"--strategy-option expects KEY=VALUE with KEY an option name of the strategy. Received: "
                                       f"{item!r}. Example: --strategy-option mode=async --strategy-option staleness=2.")
        if key in options:
            raise InvalidArgumentError(f"--strategy-option {key} is given twice. Received: {list(items)}. Give each option once.")
        options[key] = _value(text.strip())
    return options


def encode_strategy_options(options: Mapping[str, Any]) -> str:
    """Return the value of ``TOWERS_STRATEGY_OPTIONS`` for ``options``."""
    return json.dumps(dict(options), sort_keys=True)


def decode_strategy_options(text: str) -> dict[str, Any]:
    """Return the options in a ``TOWERS_STRATEGY_OPTIONS`` value.

    Raises:
        ValueError: when it is not a JSON object of option names.
    """
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(isinstance(k, str) and _KEY.match(k) for k in value):
        raise InvalidArgumentError(f"{ENV} must be a JSON object of strategy options. Received: {text!r}. "
                                   'Example: {"mode": "async", "staleness": 2} (towers launch --strategy-option sets it).')
    return value
