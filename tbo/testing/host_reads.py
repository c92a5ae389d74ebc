"""`forbid_host_reads`: a test guard that fails, by name, on any host read of a tensor's values inside its scope.

A split decode step must never read the device on the host: each read is a graph break for torch.compile, a failed
CUDA-graph capture, and, eager on a GPU, a drain of every queued kernel (the other microbatch's included). A CPU has
no device to wait for, so nothing there shows a read; this guard does. It is a ``TorchFunctionMode`` that raises
`HostReadError` on the calls that bring a value to Python (``item``, ``tolist``, ``__bool__``, ``__int__``,
``__float__``, ``__index__``, ``torch.equal``, ``numpy``) and on the ops whose output shape depends on the values
(``nonzero``, ``argwhere``, ``unique``, ``bincount``, ``masked_select``, ``repeat_interleave`` by a tensor without
``output_size``, indexing by a boolean mask). Shapes, dtypes and devices are metadata: free to read, and allowed.

``allow``: module-name prefixes whose own reads are let through (the frame that makes the call is looked up), e.g.
a framework's kernels inside a step whose tbo part is being checked.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Sequence

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostReadError", "HostReadGuard", "forbid_host_reads"]

#: calls that bring a tensor's value to the host
_VALUE_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "equal",
                          "numpy", "is_nonzero", "allclose"})
#: ops whose output shape is decided by the values (a host read to size the output)
_DATA_SHAPED = frozenset({"nonzero", "argwhere", "unique", "unique_consecutive", "bincount", "masked_select",
                          "nonzero_static_fallback"})


class HostReadError(RuntimeError):
    """A tensor's value was read on the host inside `forbid_host_reads`."""


def _bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


def _what(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """The host read ``func(*args, **kwargs)`` makes, or None."""
    name = getattr(func, "__name__", "")
    if name in _VALUE_READS or name in _DATA_SHAPED:
        return name
    if name == "repeat_interleave" and "output_size" not in kwargs:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor):
            return "repeat_interleave by a tensor without output_size"
    if name == "__getitem__" and len(args) > 1 and _bool_index(args[1]):
        return "indexing by a boolean mask"
    return None


class HostReadGuard(TorchFunctionMode):
    """The mode `forbid_host_reads` enters; ``reads`` lists what it refused (the first raised)."""

    def __init__(self, allow: Sequence[str] = ()) -> None:
        super().__init__()
        self.allow = tuple(allow)
        self.reads: list[str] = []

    def _allowed(self) -> bool:
        if not self.allow:
            return False
        frame = sys._getframe(2)  # the caller of the call refused (skip this method and __torch_function__)
        while frame is not None and frame.f_globals.get("__name__", "").startswith("torch"):
            frame = frame.f_back  # a read made inside torch's own Python code is its caller's
        name = frame.f_globals.get("__name__", "") if frame is not None else ""
        return name.startswith(self.allow)

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        what = _what(func, args, kwargs)
        if what is not None and not self._allowed():
            frame = sys._getframe(1)
            where = f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
            self.reads.append(f"{what} at {where}")
            raise HostReadError(f"host read inside a step that must not read the host: {what}, at {where}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbid_host_reads(allow: Sequence[str] = ()) -> Iterator[HostReadGuard]:
    """Raise `HostReadError` on any host read of a tensor's value inside this scope (see the module docstring)."""
    guard = HostReadGuard(allow)
    with guard:
        yield guard
