"""One shape for user-facing errors: what was wrong, the value received, and what to do."""

from __future__ import annotations

from typing import Any

__all__ = ["user_error"]

_MAX_SHOWN = 300


def user_error(what: str, received: Any, fix: str, *, cls: type[Exception] = ValueError) -> Exception:
    """Return ``cls("<what>. Received: <received>. <fix>")``; a long value is cut to 300 characters.

    ``received`` is shown with ``repr`` unless it is already a string describing it (pass ``str``
    values through ``repr`` yourself when the quotes matter).
    """
    shown = received if isinstance(received, str) else repr(received)
    if len(shown) > _MAX_SHOWN:
        shown = shown[:_MAX_SHOWN] + "..."
    return cls(f"{what.rstrip('.')}. Received: {shown}. {fix}")
