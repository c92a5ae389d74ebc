"""Two device facts every GPU path needs, answered the same way everywhere (and safely on a CPU-only build).

* **Which device.** ``torch.device("cuda") != torch.device("cuda:0")``, yet a tensor made on the first lands on the
  second: a cache keyed by the one is never found by the other (a second copy stream, staging allocated again, maybe
  inside a capture). `device_key` gives the index-ful device that tensors report; key every per-device cache by it.
* **Inside a capture?** ``torch.cuda.is_current_stream_capturing`` raises on a CPU-only build. `capturing` is False
  off CUDA. While a graph is captured a host sync (``event.synchronize()``, ``.item()``) invalidates the capture, and
  a device-side assert would be baked into every replay: code that must act differently asks here.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["device_key", "capturing"]


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
