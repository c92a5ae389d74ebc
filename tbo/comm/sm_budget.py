"""SM budgets for GPU kernels that share the device with communication: set for a scope, restored on exit.

In prefill TBO, DeepEP's communication kernels occupy some SMs while the other microbatch's GEMMs run; DeepGEMM must
be told to leave them free, and the old value must come back afterwards even when the forward raises. DeepEP V1
sets its SM count globally (``Buffer.set_num_sms``); V2 takes it per call, from
``ElasticBuffer.get_theoretical_num_sms``, and has no zero-SM mode, so decode needs a budget with V2 as well.
It lives in `tbo.comm` because every budget starts from what the communication kernels take; the strategies and
the runtime above read it.

Three things the budget must know, from DeepEP's source (``docs/deepep.md`` cites the lines):

* V1 normal buffers are sized for the ``Buffer.num_sms`` in effect when they are made (a channel per two SMs), and
  DeepEP reads ``Buffer.num_sms`` again at every call: raising it afterwards overruns them. `deep_ep_num_sms`
  refuses, given the backends (``backends=``), a count their buffers cannot hold.
* V2 on one rank has no traffic to size by, and ``get_theoretical_num_sms`` gives every SM: its kernels then take
  the whole device, and `gemm_num_sms_beside` has nothing to leave beside them (None: no DeepGEMM budget).
* V2's copy and reduce epilogues run on every SM whatever ``num_sms`` says: no budget keeps the GEMMs running
  through them (the simulator charges them as compute: ``CostModel.epilogues``).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from tbo.util.optional import require, try_import

__all__ = ["deep_gemm_num_sms", "deep_ep_num_sms", "deep_ep_elastic_num_sms", "gemm_num_sms_beside", "save_restore"]

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
def deep_ep_num_sms(num_sms: int | None, buffer_cls: Any = None, backends: Sequence[Any] = ()) -> Iterator[None]:
    """Give DeepEP's high-throughput kernels ``num_sms`` SMs inside the scope (DeepEP requires an even count).

    ``buffer_cls`` defaults to ``deep_ep.Buffer`` (imported here, so this needs deep_ep unless one is passed).
    ``backends``: the `DeepEPNormalBackend`s that will run in the scope; a count their buffers, sized when they were
    made, cannot hold is refused before any kernel runs (ValueError naming the bytes), and the old count stays.
    """
    if num_sms is None:
        yield
        return
    if buffer_cls is None:
        buffer_cls = getattr(require("deep_ep", "deep_ep_num_sms"), "Buffer", None)
        if buffer_cls is None:
            raise ImportError("deep_ep_num_sms sets V1's Buffer.num_sms, but this deep_ep has no Buffer; DeepEP V2 "
                              "takes num_sms per call: see deep_ep_elastic_num_sms")
    with save_restore(lambda: buffer_cls.num_sms, buffer_cls.set_num_sms, num_sms):
        for backend in backends:  # the configs now in effect, against each buffer's bytes
            backend.check_buffer_fits()
        yield


def deep_ep_elastic_num_sms(buffer: Any, num_experts: int, num_topk: int) -> int:
    """The SMs DeepEP V2's dispatch and combine kernels take: ``buffer.get_theoretical_num_sms(num_experts,
    num_topk)``, checked to be a positive even count (what V2 returns, and what its kernels need)."""
    num_sms = int(buffer.get_theoretical_num_sms(num_experts, num_topk))
    if num_sms < 2 or num_sms % 2:
        raise ValueError(f"get_theoretical_num_sms({num_experts}, {num_topk}) returned {num_sms}; DeepEP needs a "
                         "positive even SM count")
    return num_sms


def gemm_num_sms_beside(comm_num_sms: int | None, device_sms: int | None = None) -> int | None:
    """The SMs left for DeepGEMM while communication kernels hold ``comm_num_sms``.

    ``device_sms`` defaults to the current CUDA device's count. None (no budget) when communication takes no SMs
    (None or 0: DeepEP V1's low-latency hooks), when it takes every SM (DeepEP V2 on one rank: its kernels then run
    alone, and DeepGEMM keeps the whole device between them), or, without ``device_sms``, when there is no GPU to
    ask. More SMs than the device has is an error.
    """
    if not comm_num_sms:
        return None
    if device_sms is None:
        import torch

        if not torch.cuda.is_available():
            return None
        device_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if comm_num_sms == device_sms:
        log.info("communication takes all %d SMs (DeepEP V2 on one rank?): no DeepGEMM budget, nothing overlaps it",
                 device_sms)
        return None
    if not 0 < comm_num_sms < device_sms:
        raise ValueError(f"communication takes {comm_num_sms} SMs of the device's {device_sms}: not a count the device "
                         "has")
    return device_sms - comm_num_sms
