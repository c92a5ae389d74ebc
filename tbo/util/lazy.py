"""`lazy_attributes`: a package attribute that imports its module on first use (PEP 562).

`import tbo` must work without torch (the core needs none), yet `tbo.split_inputs` is one attribute away. Names whose
modules need torch are listed here and imported only when touched, so a missing torch surfaces where it is needed.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable, Mapping

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, names: Mapping[str, str], submodules: Iterable[str] = ()) -> Callable[[str], Any]:
    """A module ``__getattr__`` resolving each of ``names`` (attribute -> module path) on first access, and each of
    ``submodules`` to the subpackage itself, so that `import tbo; tbo.strategies.register(...)` works as written."""
    submodules = frozenset(submodules)

    def __getattr__(attr: str) -> Any:
        if attr in submodules:
            return importlib.import_module(f"{package}.{attr}")  # importing binds it on the package
        module = names.get(attr)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {attr!r}")
        value = getattr(importlib.import_module(module), attr)
        setattr(importlib.import_module(package), attr, value)  # later lookups skip this hook
        return value

    return __getattr__
