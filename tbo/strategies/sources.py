"""Strategies from an engine's configuration: by value (the JSON `OperationsStrategy.model_dump_json` writes) and
from modules that register them, registered in the process that reads the configuration.

`tbo.strategies.register` in a user's script reaches only that process; an engine runs its model in others (vLLM's
engine core, its TP and DP workers, the OpenAI server's). An engine's configuration does reach every one of them, so
strategies written into it, or modules named in it, are registered wherever it is read. This module is the
engine-neutral part: vLLM's ``additional_config["tbo"]`` keys ``strategies`` and ``strategy_modules`` call it, and so
can SGLang's or an in-house engine's.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Iterable, Mapping

from tbo.core.errors import StrategyError
from tbo.core.strategy import OperationsStrategy
from tbo.strategies import registry

__all__ = ["parse_strategy", "register_from_config", "import_modules"]

#: names registered from a configuration in this process: a later configuration may give such a name another value
#: (an engine restarted with an edited strategy), while built-in and Python-registered names stay as they are
_FROM_CONFIG: set[str] = set()


def parse_strategy(name: str, value: Any) -> OperationsStrategy:
    """The strategy ``value`` describes: `model_dump_json`'s text, or that JSON parsed (a dict, as a nested JSON
    object in a command line's config arrives). Its checks are the constructor's; an error names ``name``."""
    try:
        if isinstance(value, (str, bytes)):
            strategy = OperationsStrategy.model_validate_json(value)
        elif isinstance(value, Mapping):
            strategy = OperationsStrategy.model_validate(dict(value))
        else:
            raise StrategyError(f"expected the JSON text strategy.model_dump_json() writes, or that JSON as an "
                                f"object; got {type(value).__name__}")
    except StrategyError as exc:
        raise StrategyError(f"strategy {name!r}: {exc}") from None
    return strategy if strategy.name == name else strategy._replace(name=name)


def import_modules(names: Iterable[str], what: str = "strategy_modules") -> list[ModuleType]:
    """Import each module (which registers strategies when imported); a failure names the module and ``what``."""
    modules = []
    for name in names:
        if not isinstance(name, str) or not name:
            raise StrategyError(f"{what}: {name!r} is not a module name")
        try:
            modules.append(importlib.import_module(name))
        except Exception as exc:  # an import runs the user's code: whatever it raises is this module's failure
            raise StrategyError(f"{what}: cannot import {name!r} ({type(exc).__name__}: {exc}); it must be "
                                "importable in every process of the engine (installed, or on PYTHONPATH)") from exc
    return modules


def register_from_config(strategies: Mapping[str, Any] | None = None, modules: Iterable[str] | None = None,
                         where: str = "") -> list[str]:
    """Import ``modules``, then register each of ``strategies`` (name -> JSON) under its name; return the names.

    A name that is built in or registered from Python is refused (choose another); one registered from a config
    before takes the new value. Registering the same value twice is a no-op, as a process may read its config more
    than once.
    """
    where = f"{where} " if where else ""
    import_modules(modules or (), f"{where}strategy_modules")
    if strategies is None:
        return []
    if not isinstance(strategies, Mapping):
        raise StrategyError(f"{where}strategies: expected a mapping of name to strategy JSON, got "
                            f"{type(strategies).__name__}")
    parsed = {}
    for name, value in strategies.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise StrategyError(f"{where}strategies: the name {name!r} must be an identifier")
        parsed[name] = parse_strategy(name, value)
        if name in registry.names() and name not in _FROM_CONFIG:
            if _same(registry.get(name), parsed[name]):
                continue  # the same strategy, registered from Python too
            raise StrategyError(f"{where}strategies: {name!r} is already a registered strategy (built in, or "
                                "registered from Python); give yours another name")
    for name, strategy in parsed.items():
        registry.register(name, strategy, overwrite=True)
        _FROM_CONFIG.add(name)
    return list(parsed)


def _same(a: OperationsStrategy, b: OperationsStrategy) -> bool:
    try:
        return a.model_dump_json() == b.model_dump_json()
    except StrategyError:  # one holds callables: not what a config can say
        return False
