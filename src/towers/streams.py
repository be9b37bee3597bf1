"""Public path kept for users: the streaming input lives in ``towers.data.streams`` (see its docstring)."""

from towers.data.streams import *  # noqa: F401,F403
from towers.data.streams import __all__ as __all__
