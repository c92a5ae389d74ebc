"""Operations and the `Yield` marker: the vocabulary strategies are written in.

An operation is either a callable ``op(state, **inputs) -> dict | None`` or a string ``"name"`` that later resolves to a
layer's method ``op_<name>``. Strings keep strategies as data (printable, JSON-serialisable, shareable across layers);
callables let users drop in a plain function. ``Yield`` separates stages: at a Yield the running microbatch hands
control to the next one.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol, Union

__all__ = ["Yield", "YieldType", "Operation", "OpCallable", "op_name", "is_yield", "YIELD_NAME", "comm_role",
           "KNOWN_LAUNCHES", "KNOWN_WAITS"]

#: The string that stands for ``Yield`` in JSON and in string lists. No layer may name an op ``op_Yield``.
YIELD_NAME = "Yield"


class YieldType:
    """The type of the singleton `Yield`. There is exactly one instance; compare with ``is``.

    Write ``Yield`` in a strategy list. ``Yield()`` is the same marker, for code ported from frameworks whose marker
    is a class (SGLang's ``YieldOperation()``); the string ``"Yield"`` is accepted only in data (JSON), never in a
    Python list, where it is an error naming its index.
    """

    _instance: "YieldType | None" = None
    __slots__ = ()

    def __new__(cls) -> "YieldType":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return YIELD_NAME

    def __reduce__(self) -> str:  # pickles (e.g. to spawned processes) as the same singleton
        return "Yield"

    def __call__(self) -> "YieldType":
        """``Yield()`` is ``Yield``: the marker, not an op."""
        return self


Yield = YieldType()


class OpCallable(Protocol):
    """What a callable operation looks like: the microbatch's state, plus what the previous op returned."""

    def __call__(self, state: Any, /, **inputs: Any) -> dict[str, Any] | None: ...


#: An item of a strategy list, other than Yield.
Operation = Union[str, Callable[..., "dict[str, Any] | None"]]


def is_yield(item: object) -> bool:
    """True for the `Yield` marker and for its string form ``"Yield"`` (as read back from JSON; a strategy built
    from Python refuses the string, see `YieldType`)."""
    return item is Yield or (isinstance(item, str) and item == YIELD_NAME)


def op_name(op: Operation) -> str:
    """The debug name of an operation: a string as is, else the callable's ``__name__`` without a leading ``op_``.

    Bound methods, ``functools.partial`` and callable objects are unwrapped so that the name is the one a user wrote.
    """
    if isinstance(op, str):
        return op
    target: Any = op
    while isinstance(target, functools.partial):
        target = target.func
    name = getattr(target, "__name__", None) or type(target).__name__
    return name[3:] if name.startswith("op_") and len(name) > 3 else name


#: Communication ops whose names do not follow the ``X_a`` / ``X_b`` rule.
KNOWN_LAUNCHES = {"afd_send": "afd"}
KNOWN_WAITS = {"afd_recv": "afd"}


def comm_role(name: str, launches: dict[str, str] | None = None, waits: dict[str, str] | None = None
              ) -> tuple[str, str] | None:
    """("launch" | "wait", transfer kind) for a communication op, None for compute.

    ``X_a`` launches transfer ``X`` and ``X_b`` waits for it; ``afd_send``/``afd_recv`` launch and wait ``afd``;
    ``launches``/``waits`` add names of your own.
    """
    for table, role in ((launches, "launch"), (KNOWN_LAUNCHES, "launch"), (waits, "wait"), (KNOWN_WAITS, "wait")):
        if table and name in table:
            return role, table[name]
    if name.endswith("_a") and len(name) > 2:
        return "launch", name[:-2]
    if name.endswith("_b") and len(name) > 2:
        return "wait", name[:-2]
    return None
