"""The strategy registry: built-in strategies by name, and a place for users to add their own.

Entries are factories, called on `get`, so nothing is probed at import time (the prefill SM budget asks the GPU).
"""

from __future__ import annotations

from typing import Callable, Union

from tbo.core.errors import StrategyError
from tbo.core.strategy import OperationsStrategy

__all__ = ["register", "get", "names", "unregister"]

Entry = Union[OperationsStrategy, Callable[[], OperationsStrategy]]
_REGISTRY: dict[str, Entry] = {}


def register(name: str, strategy: Entry, *, overwrite: bool = False) -> None:
    """Add a strategy (or a zero-argument factory of one) under ``name``."""
    if not name.isidentifier():
        raise StrategyError(f"strategy name {name!r} must be an identifier")
    if name in _REGISTRY and not overwrite:
        raise StrategyError(f"a strategy named {name!r} is already registered; pass overwrite=True to replace it")
    if not isinstance(strategy, OperationsStrategy) and not callable(strategy):
        raise StrategyError(f"register({name!r}, ...) needs an OperationsStrategy or a factory of one")
    _REGISTRY[name] = strategy


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def get(name: str) -> OperationsStrategy:
    """The strategy registered as ``name``; the error lists the names there are."""
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise StrategyError(f"no strategy named {name!r}; registered: {', '.join(names())}") from None
    strategy = entry if isinstance(entry, OperationsStrategy) else entry()
    if not isinstance(strategy, OperationsStrategy):
        raise StrategyError(f"the factory registered as {name!r} returned {type(strategy).__name__}")
    return strategy if strategy.name == name else strategy._replace(name=name)


def names() -> list[str]:
    return sorted(_REGISTRY)
