"""`State`: the per-microbatch store that ops read and write.

Each microbatch owns one State, which is what makes two microbatches in flight safe: a handle launched by
``dispatch_a`` of microbatch 0 lives in microbatch 0's State, and ``dispatch_b`` of microbatch 0 finds it there.
Keys are write-once so that one op cannot silently overwrite another's tensor, and ``clear(expect_keys=...)`` at the
end of a layer catches tensors that would otherwise leak into the next layer.

Pinned keys (``state.pin(...)``) hold step-scoped metadata such as the microbatch's ``microbatch_idx``: they survive
``clear`` and cannot be popped, so every layer's ops can read them.

Values live in the instance ``__dict__`` so reads are plain attribute loads, as fast as any Python object.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

__all__ = ["State"]

_MISSING: Any = object()


class State:
    """Attribute-style, write-once key/value store for one microbatch."""

    __slots__ = ("__dict__", "_pinned")

    def __init__(self, **values: Any) -> None:
        object.__setattr__(self, "_pinned", frozenset())
        self.update(**values)

    def pin(self, **values: Any) -> None:
        """Set step-scoped keys that `clear` keeps and `pop` refuses: metadata every layer reads."""
        self.update(**values)
        object.__setattr__(self, "_pinned", self._pinned | frozenset(values))

    @property
    def pinned(self) -> frozenset[str]:
        return self._pinned

    # ---- writes -------------------------------------------------------------------------------------------------
    def __setattr__(self, key: str, value: Any) -> None:
        d = self.__dict__
        if key in d:
            raise AttributeError(
                f"State key {key!r} is already set; keys are write-once, pop it first if you mean to replace it"
            )
        if hasattr(State, key):
            raise AttributeError(f"State key {key!r} would shadow the State method of that name; choose another")
        d[key] = value

    def __delattr__(self, key: str) -> None:
        self.pop(key)

    def update(self, **values: Any) -> None:
        """Set several keys; each must be new. Nothing is written if any key already exists."""
        clash = sorted(k for k in values if k in self.__dict__)
        if clash:
            raise AttributeError(f"State keys {clash} are already set; keys are write-once")
        for key, value in values.items():
            setattr(self, key, value)

    # ---- reads --------------------------------------------------------------------------------------------------
    def __getattr__(self, key: str) -> Any:  # only called when normal lookup fails, i.e. the key is missing
        if key.startswith("__"):
            raise AttributeError(key)
        raise AttributeError(f"State has no key {key!r}; it has {sorted(self.__dict__)}")

    def get(self, key: str, default: Any = None) -> Any:
        return self.__dict__.get(key, default)

    def pop(self, key: str, default: Any = _MISSING) -> Any:
        """Remove and return a key. Without a default, a missing key raises KeyError naming the keys present."""
        if key in self._pinned:
            raise KeyError(f"State key {key!r} is pinned for the whole step and cannot be popped")
        if default is _MISSING:
            try:
                return self.__dict__.pop(key)
            except KeyError:
                raise KeyError(f"State has no key {key!r}; it has {sorted(self.__dict__)}") from None
        return self.__dict__.pop(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.__dict__

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.__dict__))

    def __len__(self) -> int:
        return len(self.__dict__)

    def keys(self) -> list[str]:
        return list(self.__dict__)

    # ---- end of layer -------------------------------------------------------------------------------------------
    def clear(self, expect_keys: Iterable[str] = ()) -> None:
        """Remove every unpinned key. Raise, and keep everything, if keys other than ``expect_keys`` remain.

        Call this at the end of a layer: a key nobody expected is a tensor some op forgot to pop, which would
        otherwise stay alive (and be read by mistake) in the next layer.
        """
        allowed = set(expect_keys) | self._pinned
        unexpected = sorted(k for k in self.__dict__ if k not in allowed)
        if unexpected:
            raise ValueError(f"State.clear: unexpected keys remain {unexpected} (expected only {sorted(allowed)})")
        for key in [k for k in self.__dict__ if k not in self._pinned]:
            del self.__dict__[key]

    def __repr__(self) -> str:
        return f"State({', '.join(sorted(self.__dict__))})"
