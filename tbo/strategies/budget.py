"""A strategy's DeepGEMM SM budget, set from the backend it runs over.

DeepEP V1's low-latency hooks take no SMs, and V1's normal mode sets its SM count globally (the prefill strategies
read it); DeepEP V2 takes ``num_sms`` per call and has no zero-SM mode, so whichever strategy runs over it, decode
included, must leave those SMs to communication. A backend that holds SMs says how many through
``comm_num_sms(num_topk)`` (`DeepEPElasticBackend` does); `sized_for` turns that into ``deep_gemm_num_sms``.
"""

from __future__ import annotations

from typing import Any

from tbo.core.strategy import OperationsStrategy
from tbo.comm.sm_budget import gemm_num_sms_beside

__all__ = ["sized_for"]


def sized_for(strategy: OperationsStrategy, backend: Any, num_topk: int,
              device_sms: int | None = None) -> OperationsStrategy:
    """``strategy`` with DeepGEMM limited to the SMs ``backend``'s communication kernels leave free.

    Unchanged for a backend without ``comm_num_sms`` (all-to-all, DeepEP V1), or where there is no GPU to size
    against (``device_sms`` None and no CUDA device).
    """
    comm = getattr(backend, "comm_num_sms", None)
    if comm is None:
        return strategy
    budget = gemm_num_sms_beside(comm(num_topk), device_sms)
    return strategy if budget is None else strategy._replace(deep_gemm_num_sms=budget)
