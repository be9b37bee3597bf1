"""The registry of strategy names: ``get_strategy``, ``strategy_from_env`` and the options each strategy takes.

Built-in strategies are rows of ``towers.cluster.roles.STRATEGIES`` (imported when first built);
``register_strategy`` adds a user's own at run time.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from towers._logging import get_logger
from towers.cluster import roles
from towers.cluster.info import ProcessInfo
from towers.cluster.launch_notes import note_strategy_built
from towers.cluster.strategy_options import parse_flag
from towers.errors import InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:
    from towers.strategies.base import Strategy

__all__ = ["note_built", "register_strategy", "strategy_names", "get_strategy", "strategy_options", "check_strategy_options",
           "strategy_from_env"]

log = get_logger(__name__)


def note_built(info: ProcessInfo, name: str) -> None:
    """Tell ``towers launch`` (when it started this process with ``--strategy``) that strategy ``name`` was built.

    Every strategy calls it while it is constructed, so the launcher can say when a job never
    used the strategy it was started with (``ProcessInfo.launch_dir``; nothing outside it).
    """
    if info.launch_dir:
        note_strategy_built(info.launch_dir, rank=info.rank, name=name)


_REGISTRY: dict[str, Callable[..., Strategy]] = {}


def _key(name: str) -> str:
    return str(name).strip().lower().replace("-", "_")


def register_strategy(name: str, factory: Callable[..., Strategy], *, aliases: Sequence[str] = ()) -> None:
    """Make ``factory`` available as ``get_strategy(name)`` (and under each alias), beside the built-in names.

    Args:
        name: the name ``get_strategy``, ``strategy_from_env`` and ``towers launch --strategy`` accept (case and
            ``-``/``_`` do not matter). Registering a name again replaces its factory.
        factory: a callable that returns a new ``Strategy``; it is called with the ``info`` of the process
            (``strategy_from_env``) and the options the script or the launcher pass.
        aliases: more names for the same factory.

    Example:
        ```python
        import towers
        from towers.strategies import get_strategy, register_strategy

        register_strategy("my_cpu", lambda **options: towers.OneDeviceStrategy("cpu", **options), aliases=["mine"])
        assert isinstance(get_strategy("mine"), towers.OneDeviceStrategy)
        ```
    """
    for key in (name, *aliases):
        _REGISTRY[_key(key)] = factory


def strategy_names() -> list[str]:
    """Return every strategy name and alias (built-in and registered), sorted.

    Returns:
        The names ``get_strategy`` accepts, e.g. ``["hybrid", "mirrored", ..., "one_device", ...]``.
    """
    return sorted({*roles.strategy_names(aliases=True), *_REGISTRY})


def _factory(name: str) -> Callable[..., Strategy]:
    factory = _REGISTRY.get(_key(name))
    if factory is None:
        module, _, attr = roles.strategy_entry(name).target.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory


def get_strategy(name: str, **kwargs: Any) -> Strategy:
    """Return a new strategy named ``name`` (e.g. ``"mirrored"``), built with ``kwargs``.

    Args:
        name: a built-in name or alias (``strategy_names()``) or one added by ``register_strategy``.
        **kwargs: the strategy's own arguments (``info=``, ``timeout_s=``, ...).

    Returns:
        The strategy, built in this process.

    Raises:
        ValueError: when no strategy has that name; the message lists the names.

    Example:
        ```python
        from towers.strategies import get_strategy

        strategy = get_strategy("one_device", device="cpu")
        assert strategy.num_replicas_in_sync == 1 and strategy.is_chief
        ```
    """
    strategy = _factory(name)(**kwargs)
    note_built(strategy.process_info, name)  # a strategy registered from outside towers, too
    return strategy


def strategy_options(name: str) -> set[str] | None:
    """Return the keyword options strategy ``name`` takes (None: any, its factory takes ``**kwargs``)."""
    parameters = inspect.signature(_factory(name)).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - {"self", "info"}


def _takers(option: str) -> list[str]:
    names = sorted({roles.canonical_strategy(n) if n in roles.strategy_names(aliases=True) else n
                    for n in strategy_names()})
    return [n for n in names if (taken := strategy_options(n)) is None or option in taken]


def _typed(name: str) -> dict[str, str]:
    """The options of strategy ``name`` that are a bool or a number: option -> its annotation (``"float | None"``)."""
    return {p.name: str(p.annotation) for p in inspect.signature(_factory(name)).parameters.values()
            if p.annotation in ("bool", "int", "float", "int | None", "float | None")}


def _check_value(name: str, key: str, value: Any, annotation: str) -> None:
    """Refuse an option's value of the wrong kind before any process starts (the strategy checks its range)."""
    if annotation == "bool":
        parse_flag(key, value)  # `cpu_offload=perhaps` is no True
        return
    kinds: tuple[type, ...] = (int,) if annotation.startswith("int") else (int, float)
    if (value is None and annotation.endswith("None")) or (isinstance(value, kinds) and not isinstance(value, bool)):
        return
    example = 2 if kinds == (int,) else 25
    raise InvalidArgumentError(f"Strategy {name!r} takes {key} as {'an integer' if kinds == (int,) else 'a number'}"
                               f"{' or null' if annotation.endswith('None') else ''}. Received: --strategy-option "
                               f"{key}={value!r}. Pass e.g. --strategy-option {key}={example}.")


def check_strategy_options(name: str, options: Mapping[str, Any]) -> None:
    """Raise when strategy ``name`` does not take one of ``options`` (``--strategy-option``: it must take each one),
    or an option's value is of the wrong kind (``cpu_offload=perhaps``, ``bucket_cap_mb=abc``).

    What ``strategy_from_env`` checks in every process of ``towers launch``; ``towers k8s`` checks the
    same before it writes a manifest.

    Raises:
        ValueError: naming the option, the strategies that take it, and the options ``name`` takes; or when no
            strategy is named ``name``; or a value of the wrong kind (a boolean neither true nor false, text for a
            number).
    """
    taken = strategy_options(name)
    if taken is None:
        return
    typed = _typed(name)
    for key, value in options.items():
        if key in typed:
            _check_value(name, key, value, typed[key])
        if key not in taken:
            others = [n for n in _takers(key) if n != name]
            if key == "mesh":
                raise InvalidArgumentError(
                    f"Strategy {name!r} takes no mesh (it does not take the option 'mesh'): a device mesh lays out "
                    f"tensor, pipeline and sharded data parallelism, and only --strategy {', '.join(others) or 'sharded'} takes "
                    f"one. Received: --mesh {value} with "
                    f"--strategy {name}. Drop --mesh, or use --strategy {others[0] if others else 'sharded'} --mesh "
                    f"{value}.")
            raise InvalidArgumentError(
                f"Strategy {name!r} does not take the option {key!r}. Received: --strategy-option {key}={value!r} "
                f"(TOWERS_STRATEGY_OPTIONS). {f'{key!r} is an option of {others}; ' if others else ''}{name!r} takes "
                f"{sorted(taken)}. Drop it or pick another --strategy.")


def _options_for(name: str, launcher: Mapping[str, Any], script: Mapping[str, Any]) -> dict[str, Any]:
    """The options strategy ``name`` gets: the launcher's (which it must take) over the script's own."""
    check_strategy_options(name, launcher)
    taken = strategy_options(name)
    if taken is None:
        return {**script, **launcher}
    options = {}
    for key, value in script.items():
        if key in taken:
            options[key] = value
            continue
        others = _takers(key)
        if not others:
            raise InvalidTypeError(f"strategy_from_env() got an option no strategy takes. Received: {key}={value!r}. "
                                   f"{name!r} takes {sorted(taken)}.")
        # The same script runs under every strategy: an option of another one is not this one's business.
        log.debug("strategy %s does not take %s=%r (an option of %s): not passed", name, key, value, others)
    return {**options, **launcher}


def strategy_from_env(info: ProcessInfo | None = None, **kwargs: Any) -> Strategy:
    """Return the strategy ``towers launch --strategy`` (or TF_CONFIG, torchrun, SLURM) asked for.

    Without a request: ``one_device`` for a single process, ``mirrored`` on one host,
    ``multi_worker_mirrored`` across hosts. So the same script runs as one process (``python train.py``)
    and as N replicas (``towers launch --nproc-per-node N --strategy ... train.py``), unchanged.

    Args:
        info: this process's place in the job. Default: read from the environment
            (``towers.cluster.from_env()``).
        **kwargs: the script's options: each goes to the strategy when it takes it, and is left out when
            only other strategies take it (so ``strategy_from_env(mode="sync")`` runs under Mirrored too).
            Options from outside (``towers launch --strategy-option``) win over them, and the strategy must
            take each one.

    Returns:
        The strategy, built in this process.

    Raises:
        ValueError: an option from outside that the strategy does not take (naming those that do).
        TypeError: an option of the script that no strategy takes.

    Example:
        ```python
        import towers

        strategy = towers.strategy_from_env()  # OneDeviceStrategy when run as one process
        print(type(strategy).__name__, strategy.num_replicas_in_sync, strategy.device)
        ```
    """
    from towers import cluster

    info = info or cluster.from_env()
    name = info.strategy
    if name is None:
        if info.world_size == 1:
            name = "one_device"
        elif info.local_world_size == info.world_size:
            name = "mirrored"
        else:
            name = "multi_worker_mirrored"
    return get_strategy(name, info=info, **_options_for(name, info.strategy_options, kwargs))
