"""Two device facts every GPU path needs, answered the same way everywhere (and safely on a CPU-only build).

* **Which device.** ``torch.device("cuda") != torch.device("cuda:0")``, yet a tensor made on the first lands on the
  second: a cache keyed by the one is never found by the other (a second copy stream, staging allocated again, maybe
  inside a capture). `device_key` gives the index-ful device that tensors report; key every per-device cache by it.
* **Inside a capture?** ``torch.cuda.is_current_stream_capturing`` raises on a CPU-only build. `capturing` is False
  off CUDA. While a graph is captured a host sync (``event.synchronize()``, ``.item()``) invalidates the capture, and
  a device-side assert would be baked into every replay: code that must act differently asks here.
* **May this step read the host?** Not inside a capture, not while torch.compile traces (a read is a graph break),
  and not inside `no_host_reads`, the scope in which a framework declares a step that must never read a device
  tensor on the host (a split decode step: a read there drains every queued kernel, the other microbatch's too).
  `host_reads_forbidden` answers; the paths that size their outputs by counts read on the host (NORMAL routes, the
  experts runner, routing checks) take their fixed-shape form when it is True.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch

__all__ = ["device_key", "capturing", "host_reads_forbidden", "no_host_reads"]

_NO_HOST_READS: contextvars.ContextVar[bool] = contextvars.ContextVar("tbo_no_host_reads", default=False)


def device_key(device: Any) -> torch.device:
    """``device`` as its tensors report it: a CUDA device without an index gets the current device's index."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def capturing(device: Any = None) -> bool:
    """True while the current CUDA stream is being captured into a graph; always False off CUDA (a ``device`` of
    another type, or a build or machine without CUDA)."""
    if device is not None and torch.device(device).type != "cuda":
        return False
    if not torch.cuda.is_available():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def no_host_reads(on: bool = True) -> Iterator[None]:
    """The scope of a step that must not read the device on the host: inside it (``on``), `host_reads_forbidden`
    is True and tbo's paths run with fixed shapes (see the module docstring). ``on=False`` is a no-op scope, so a
    caller can write ``with no_host_reads(step_is_split_decode):``."""
    if not on:
        yield
        return
    token = _NO_HOST_READS.set(True)
    try:
        yield
    finally:
        _NO_HOST_READS.reset(token)


def host_reads_forbidden(device: Any = None) -> bool:
    """True inside `no_host_reads`, while torch.compile traces, and while ``device``'s stream is captured."""
    if _NO_HOST_READS.get():
        return True
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and compiler.is_compiling():
        return True
    return capturing(device)
