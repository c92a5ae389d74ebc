"""Choosing a DeepEP backend: V2 (``ElasticBuffer``) when the installed deep_ep has it, else V1's two modes.

``kind``:

* ``"auto"``: ``DeepEPElasticBackend`` when ``deep_ep.ElasticBuffer`` exists (DeepEP >= 2.0), otherwise V1 by
  ``mode``: low-latency for ``"decode"``, normal for ``"prefill"``;
* ``"v2"``, ``"v1_low_latency"``, ``"v1_normal"``: exactly that one, or an ImportError saying what is missing.

V1 remains a choice on a V2 install (DeepEP 2.x still exports ``deep_ep.Buffer``, from ``deep_ep.buffers.legacy``):
V1 low-latency is the only zero-SM, CUDA-graph-friendly decode path, and the only MASKED layout (DeepGEMM's masked
GEMM).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from tbo.util.optional import require
from tbo.comm.deepep import DeepEPLowLatencyBackend, DeepEPNormalBackend, v1_buffer_class
from tbo.comm.deepep_elastic import DeepEPElasticBackend, elastic_buffer_class
from tbo.comm.types import DispatchFormat

__all__ = ["deepep_backend", "DEEPEP_KINDS", "DEEPEP_MODES"]

DEEPEP_KINDS = ("auto", "v2", "v1_low_latency", "v1_normal")
DEEPEP_MODES = ("decode", "prefill")


def deepep_backend(group: Any, num_experts: int, *, hidden: int, num_max_tokens_per_rank: int, num_topk: int,
                   kind: str = "auto", mode: str = "prefill", use_fp8: bool = False,
                   format: DispatchFormat | None = None, deterministic: bool = True,
                   deep_ep: ModuleType | None = None, **kwargs: Any) -> Any:
    """A DeepEP `EPBackend` for ``group``, sized for ``num_max_tokens_per_rank`` tokens of ``hidden`` channels with
    top-``num_topk`` routing over ``num_experts`` experts.

    ``format`` (V2 only): NORMAL (default) or EXPANDED. ``deterministic`` (V2 only; V1 receives in a fixed order):
    V2's sorted receive order, which tbo's bit-exact promise needs; False trades it for speed, results then agree to
    rounding. ``deep_ep``: a module to use instead of importing it (the CPU stand-ins, in tests). ``kwargs`` go to
    the backend's ``create`` (e.g. ``buffer=`` to share a V2 buffer, ``num_nvl_bytes=`` for V1 normal mode, sized
    from ``Buffer.get_dispatch_config`` otherwise).
    """
    if kind not in DEEPEP_KINDS:
        raise ValueError(f"unknown DeepEP backend kind {kind!r}; expected one of {', '.join(DEEPEP_KINDS)}")
    if mode not in DEEPEP_MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(DEEPEP_MODES)}")
    module = deep_ep if deep_ep is not None else require("deep_ep", f"deepep_backend(kind={kind!r})")
    if kind == "auto":
        if getattr(module, "ElasticBuffer", None) is not None:
            kind = "v2"
        else:
            kind = "v1_low_latency" if mode == "decode" else "v1_normal"
    if format is not None and kind != "v2":
        raise ValueError(f"format= chooses V2's layout; {kind} has a fixed one "
                         f"({'MASKED' if kind == 'v1_low_latency' else 'NORMAL'})")
    if kind == "v2":
        elastic_buffer_class(module, "deepep_backend(kind='v2')")
        return DeepEPElasticBackend.create(group, num_experts, num_max_tokens_per_rank, hidden, num_topk,
                                           use_fp8=use_fp8, format=format or DispatchFormat.NORMAL,
                                           deterministic=deterministic, deep_ep=module, **kwargs)
    buffer_cls = v1_buffer_class(module, f"deepep_backend(kind={kind!r})")
    if kind == "v1_low_latency":
        return DeepEPLowLatencyBackend.create(group, num_experts, num_max_tokens_per_rank, hidden, use_fp8=use_fp8,
                                              deep_ep=module, **kwargs)
    num_ranks = group.size()
    hidden_bytes = hidden * 2  # BF16 rows; FP8 rows are smaller
    nvl = kwargs.pop("num_nvl_bytes", None)
    rdma = kwargs.pop("num_rdma_bytes", None)
    configs = (buffer_cls.get_dispatch_config(num_ranks), buffer_cls.get_combine_config(num_ranks))
    if nvl is None:
        nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) for c in configs)
    if rdma is None:
        rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) for c in configs)
    return DeepEPNormalBackend.create(group, num_experts, nvl, rdma, use_fp8=use_fp8, deep_ep=module, hidden=hidden,
                                      **kwargs)
