"""towers' errors: one base class for all of them, and one shape for the message (what was wrong, the value
received, and what to do).

``except towers.TowersError`` catches every error towers raises for a person to act on. Each is also the
builtin it was before towers had its own classes (an ``InvalidArgumentError`` is a ``ValueError``), so code
that catches the builtin keeps working. The names are TensorFlow's (``tf.errors.InvalidArgumentError``, ...).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "NotFoundError",
    "TowersError",
    "UnimplementedError",
    "user_error",
]

_MAX_SHOWN = 300


class TowersError(Exception):
    """The base of every error towers raises for a person to act on: ``except towers.TowersError`` catches them all.

    Every subclass also derives from the builtin exception that describes it (``ValueError``,
    ``RuntimeError``, ...), so ``except ValueError`` catches towers' ``ValueError`` s as before.
    """


class InvalidArgumentError(TowersError, ValueError):
    """A value given to towers (an argument, an option, a file's content) is wrong; also a ``ValueError``."""


class InvalidTypeError(TowersError, TypeError):
    """An object of the wrong type was given to towers, or does not support what was asked; also a ``TypeError``."""


class FailedPreconditionError(TowersError, RuntimeError):
    """The call is refused in the current state (e.g. a step before ``prepare``); also a ``RuntimeError``."""


class UnimplementedError(TowersError, NotImplementedError):
    """towers does not support this (yet); the message says what to use instead. Also a ``NotImplementedError``."""


class NotFoundError(TowersError, FileNotFoundError):
    """A file or directory towers needs does not exist; also a ``FileNotFoundError``."""


class DeadlineExceededError(TowersError, TimeoutError):
    """An operation did not finish within its timeout; also a ``TimeoutError``."""


# A traceback prints "<module>.<class>: <message>": show the name users catch ("towers.InvalidArgumentError: ..."),
# not this file's. towers exports each name, so pickling (errors sent between processes) finds them there.
for _cls in (TowersError, InvalidArgumentError, InvalidTypeError, FailedPreconditionError, UnimplementedError,
             NotFoundError, DeadlineExceededError):
    _cls.__module__ = "towers"
del _cls

# The builtin each towers class stands for: user_error(cls=<builtin>) returns the towers class.
_TOWERS_CLASS: dict[type[Exception], type[TowersError]] = {
    ValueError: InvalidArgumentError,
    TypeError: InvalidTypeError,
    RuntimeError: FailedPreconditionError,
    NotImplementedError: UnimplementedError,
    FileNotFoundError: NotFoundError,
    TimeoutError: DeadlineExceededError,
}


def user_error(what: str, received: Any, fix: str, *, cls: type[Exception] = ValueError) -> Exception:
    """Return ``cls("<what>. Received: <received>. <fix>")``; a long value is cut to 300 characters.

    Args:
        what: what was expected, e.g. ``"global_batch_size must be positive"``.
        received: the value received, shown with ``repr`` unless it is already a string describing it
            (pass ``str`` values through ``repr`` yourself when the quotes matter).
        fix: how to fix it, one sentence.
        cls: the class. A builtin towers has its own class for (``ValueError``, ``TypeError``,
            ``RuntimeError``, ``NotImplementedError``, ``FileNotFoundError``, ``TimeoutError``) gives that
            ``TowersError`` subclass (``ValueError`` -> ``InvalidArgumentError``, still a ``ValueError``); a
            ``TowersError`` subclass is used as it is; any other class (``OSError``, ``ImportError``, ...)
            is used as it is too, and is then not a ``TowersError``.

    Returns:
        The exception, for the caller to raise.

    Example:
        ```python
        from towers.errors import InvalidArgumentError, user_error

        error = user_error("steps must be positive", -3, "Pass steps >= 1.")
        assert isinstance(error, InvalidArgumentError) and isinstance(error, ValueError)
        assert str(error) == "steps must be positive. Received: -3. Pass steps >= 1."
        ```
    """
    shown = received if isinstance(received, str) else repr(received)
    if len(shown) > _MAX_SHOWN:
        shown = shown[:_MAX_SHOWN] + "..."
    return _TOWERS_CLASS.get(cls, cls)(f"{what.rstrip('.')}. Received: {shown}. {fix}")
