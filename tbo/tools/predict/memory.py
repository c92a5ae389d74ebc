"""Whether a deployment fits in one GPU's memory: weights, KV cache and DeepEP's buffers.

A prediction for a deployment that cannot run is worse than none: Qwen3-235B decode with 256 sequences of 8K context
per GPU needs about 400 GB of KV cache per GPU, and a step time for it would mislead. `predict` refuses such a
deployment with these figures. The figures are lower bounds where the model is silent: the layers' weights only (no
embedding or LM head, as the step time), no activations, no allocator slack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from tbo.tools.predict.hardware import Hardware
from tbo.tools.predict.model import Deployment, ModelShape

__all__ = ["MemoryUse", "memory_use", "kv_bytes_per_token", "low_latency_buffer_bytes", "NORMAL_BUFFER_BYTES"]

GB = 1e9

#: What the normal and V2 kernels' buffers are charged: DeepEP's test scripts allocate 1 GB of NVLink buffer and
#: 1 GB of RDMA buffer (the size hints for the default configs are below that at the presets' EP sizes).
NORMAL_BUFFER_BYTES = 2 * GB

#: The ops of a dense layer (DENSE_OPS less the communication bookkeeping, which has no weights): attention and MLP.
_DENSE_WEIGHT_OPS = ("attn_prepare", "attn_core", "mlp")


def kv_bytes_per_token(model: ModelShape, dep: Deployment) -> float:
    """KV-cache bytes one token holds in one layer: MLA's compressed latent and rope key, or GQA's K and V."""
    if model.attention == "mla":
        return (model.kv_lora_rank + model.qk_rope_dim) * dep.kv_bytes
    return 2.0 * model.num_kv_heads * model.head_dim * dep.kv_bytes


def low_latency_buffer_bytes(max_tokens: int, hidden: int, num_experts: int) -> int:
    """DeepEP's ``get_low_latency_rdma_size_hint``: two halves, each a send, a receive and a signalling region,
    sized for ``max_tokens`` per rank (``num_max_dispatch_tokens_per_rank``) reaching every expert."""
    scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)
    combine_msg = scales * 4 + hidden * 2
    send = max(max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    recv = num_experts * max_tokens * max(dispatch_msg, combine_msg)
    signal = -(-num_experts * 4 // 128) * 128
    return (2 * (send + recv + signal) + 128) // 128 * 128


@dataclass(frozen=True)
class MemoryUse:
    """Bytes per GPU, and the device's capacity (None: the hardware does not say, nothing is checked)."""

    weights: float
    kv_cache: float
    deepep_buffers: float
    capacity: float | None
    device: str

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.deepep_buffers

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity

    def describe(self) -> str:
        parts = (f"weights {self.weights / GB:.1f} GB + KV cache {self.kv_cache / GB:.1f} GB + DeepEP buffers "
                 f"{self.deepep_buffers / GB:.1f} GB = {self.total / GB:.1f} GB per GPU")
        if self.capacity is None:
            return f"{parts} ({self.device}: memory not given)"
        return f"{parts}, {'within' if self.fits else 'more than'} {self.device}'s {self.capacity / GB:.1f} GB"


def _weight_bytes(kernels: Mapping[str, Sequence[Any]], ops: Sequence[str]) -> float:
    # a kernel's fixed bytes are the weights it reads once per call: for the experts op, every local expert's
    return sum(k.bytes_fixed for op in ops for k in kernels.get(op, ()))


def memory_use(model: ModelShape, dep: Deployment, hw: Hardware, kernels: Mapping[str, Sequence[Any]]) -> MemoryUse:
    """Per GPU: the weights the layer kernels read (``kernels``: `layer_kernels`' table), the KV cache of the
    tokens it serves (decode: ``tokens_per_device`` sequences of ``context``; prefill: its prompt tokens), and the
    DeepEP buffers of the deployment's kernels."""
    moe_ops = [op for op in kernels if op != "mlp"]
    weights = (_weight_bytes(kernels, moe_ops) * model.num_moe_layers
               + _weight_bytes(kernels, _DENSE_WEIGHT_OPS) * model.num_dense_layers)
    cached = dep.tokens_per_device * (dep.context if dep.mode == "decode" else 1)
    kv = cached * kv_bytes_per_token(model, dep) * model.num_layers
    if dep.resolved_kernel == "low_latency":
        buffers = float(low_latency_buffer_bytes(dep.tokens_per_device, model.hidden, dep.slots(model)))
    else:
        buffers = NORMAL_BUFFER_BYTES
    return MemoryUse(weights, kv, buffers, hw.memory_bytes, hw.name)
