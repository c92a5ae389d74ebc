"""SM budgets for GPU kernels that share the device with communication: set for a scope, restored on exit.

In prefill TBO, DeepEP's communication kernels occupy some SMs while the other microbatch's GEMMs run; DeepGEMM must
be told to leave them free, and the old value must come back afterwards even when the forward raises.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from tbo.util.optional import require, try_import

__all__ = ["deep_gemm_num_sms", "deep_ep_num_sms", "save_restore"]

log = logging.getLogger(__name__)


@contextmanager
def save_restore(get: Callable[[], int], set_: Callable[[int], None], value: int) -> Iterator[None]:
    """Set a global knob to ``value`` for the scope; put the previous value back on exit, even on error."""
    previous = get()
    set_(value)
    try:
        yield
    finally:
        set_(previous)


@contextmanager
def deep_gemm_num_sms(num_sms: int | None) -> Iterator[None]:
    """Limit DeepGEMM to ``num_sms`` SMs inside the scope. A no-op for None, or when deep_gemm is not installed."""
    if num_sms is None:
        yield
        return
    deep_gemm = try_import("deep_gemm")
    if deep_gemm is None:
        log.debug("deep_gemm is not installed; ignoring deep_gemm_num_sms=%d", num_sms)
        yield
        return
    with save_restore(deep_gemm.get_num_sms, deep_gemm.set_num_sms, num_sms):
        yield


@contextmanager
def deep_ep_num_sms(num_sms: int | None, buffer_cls: Any = None) -> Iterator[None]:
    """Give DeepEP's high-throughput kernels ``num_sms`` SMs inside the scope (DeepEP requires an even count).

    ``buffer_cls`` defaults to ``deep_ep.Buffer`` (imported here, so this needs deep_ep unless one is passed).
    """
    if num_sms is None:
        yield
        return
    if buffer_cls is None:
        buffer_cls = require("deep_ep", "deep_ep_num_sms").Buffer
    with save_restore(lambda: buffer_cls.num_sms, buffer_cls.set_num_sms, num_sms):
        yield
