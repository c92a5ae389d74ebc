"""vLLM's experts kernel on the MASKED layout DeepEP low-latency delivers (issue 37, item 4).

A low-latency dispatch hands this rank ``[local experts, num_ranks * num_max_dispatch_tokens_per_rank, H]`` slabs,
expert ``e``'s first ``counts[e]`` rows valid and the rest garbage, and its combine takes slabs of that shape back:
each row the *unweighted* output of its expert (the combine applies the top-k weights and sums). That is vLLM's
"batched experts" activation format (``FusedMoEActivationFormat.BatchedExperts``), the one its own DeepEP
low-latency prepare/finalize feeds, with the counts as ``ExpertTokensMetadata.expert_num_tokens``.

`MaskedExperts` runs it with vLLM's own kernels:

* **CUDA**: ``BatchedTritonExperts``, the batched kernel vLLM's unquantized MoE oracle picks for that format, built
  from the layer's own ``moe_config`` and quant config for the slabs' capacity (vLLM builds it for DeepEP's
  ``max_num_tokens`` times the dispatchers: the same rows; only the workspaces depend on it), and called as vLLM's
  modular kernel calls experts (``apply`` with its workspaces and
  the counts on the device). It reads the standard ``[E, 2N, K]`` / ``[E, K, N]`` weights, so the layer's own kernel
  must be ``TritonExperts`` (the layout vLLM converts its weights to for it); a layer whose backend shuffled its
  weights for another kernel (FlashInfer, AITER) is refused by name when the engine starts (`check_masked_kernel`).
  Nothing is read on the host: the kernel takes the counts as a device tensor, so a CUDA graph can hold it.
* **Elsewhere** (a CPU: vLLM's CPU oracle has no batched kernel, and its weights are prepacked for its own fused
  kernel): the conversion that kernel needs. The slabs are viewed as ``L * capacity`` rows, each naming its slab's
  expert with weight 1 (top-1), rows past their expert's count zeroed first (fixed shapes: a mask from the counts,
  no host read), and the layer's own fused-experts kernel runs them behind vLLM's prepare/finalize that moves
  nothing. Weight 1 makes the kernel's weighted sum the expert's output itself, exactly; every slab row is computed
  (the padding too), which only a CPU test pays for.
"""

from __future__ import annotations

from typing import Any

import torch

from tbo.integrations.vllm.errors import TboConfigError
from tbo.integrations.vllm.model.quant import fused_experts_of, standard_kernel

__all__ = ["MaskedExperts", "check_masked_kernel"]


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def check_masked_kernel(experts: Any, name: str) -> None:
    """Refuse, naming layer ``name``, an MoE whose weights vLLM's batched kernel cannot read (CUDA only; see the
    module docstring)."""
    if not _on_cuda():
        return
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    fused = fused_experts_of(experts)
    if not isinstance(fused, TritonExperts):
        raise TboConfigError(f"{name}: DeepEP low-latency decode runs vLLM's BatchedTritonExperts on the standard "
                             f"expert weights, but this layer's kernel is {type(fused).__name__}, whose weights vLLM "
                             "may have laid out for it alone; accepted: a layer on vLLM's Triton MoE backend "
                             "(moe_backend='triton'), or deepep_decode='normal'")


class MaskedExperts:
    """The local experts of a vLLM MoE layer (``experts``, a ``RoutedExperts``) on MASKED slabs (module docstring).
    The slabs' capacity (DeepEP's ``num_ranks * num_max_dispatch_tokens_per_rank``) is read from their shape: vLLM's
    batched kernel sizes its workspaces by it, one kernel object per capacity."""

    def __init__(self, experts: Any) -> None:
        self.experts = experts
        self.cuda = _on_cuda()
        self._batched_by_capacity: dict[int, Any] = {}
        self.kernel: Any = None if self.cuda else standard_kernel(experts)

    def __call__(self, hidden: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
        """Each valid slab row's expert output, unweighted, in slabs of ``hidden``'s shape (rows past a count: zero
        on the conversion path, whatever the kernel leaves on CUDA; the combine never reads them)."""
        if hidden.dim() != 3 or hidden.shape[0] != self.experts.local_num_experts or counts.shape != hidden.shape[:1]:
            raise ValueError(f"MASKED slabs {tuple(hidden.shape)} with counts {tuple(counts.shape)}: expected "
                             f"[{self.experts.local_num_experts}, capacity, H] (this rank's experts) and one count "
                             "per expert")
        if self.cuda:
            return self._batched(hidden, counts, top_k)
        return self._converted(hidden, counts)

    def batched_kernel(self, capacity: int) -> Any:
        """vLLM's ``BatchedTritonExperts`` for slabs of ``capacity`` rows, this layer's config (CUDA)."""
        kernel = self._batched_by_capacity.get(capacity)
        if kernel is None:
            from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import BatchedTritonExperts

            e = self.experts
            kernel = self._batched_by_capacity[capacity] = BatchedTritonExperts(
                moe_config=e.moe_config, quant_config=e.quant_method.moe_quant_config, max_num_tokens=capacity,
                num_dispatchers=1)
        return kernel

    def _converted(self, hidden: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        local, capacity, width = hidden.shape
        valid = torch.arange(capacity, device=hidden.device)[None, :] < counts.to(hidden.device)[:, None]
        rows = torch.where(valid[..., None], hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
        ids = torch.arange(local, dtype=torch.int32, device=hidden.device).repeat_interleave(capacity)[:, None]
        weights = torch.ones((local * capacity, 1), dtype=torch.float32, device=hidden.device)
        e = self.experts
        out = self.kernel.apply(hidden_states=rows.reshape(local * capacity, width), w1=e.w13_weight, w2=e.w2_weight,
                                topk_ids=ids, topk_weights=weights, activation=e.activation,
                                global_num_experts=local, expert_map=None, apply_router_weight_on_input=False)
        return out.view(local, capacity, width)

    def _batched(self, hidden: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
        from vllm.model_executor.layers.fused_moe.modular_kernel import ExpertTokensMetadata

        e, batched = self.experts, self.batched_kernel(hidden.shape[1])
        hidden = hidden.contiguous()
        # what vLLM's modular kernel hands batched experts: topk ids give only the problem's top-k here
        ids = torch.zeros((1, top_k), dtype=torch.int64, device=hidden.device)
        local, m, n, k, _ = batched.moe_problem_size(hidden, e.w13_weight, e.w2_weight, ids)
        shapes = batched.workspace_shapes(m, n, k, top_k, e.global_num_experts, local, None, e.activation)
        dtype = batched.workspace_dtype(hidden.dtype)
        ws13, ws2 = (torch.empty(s, dtype=dtype, device=hidden.device) for s in shapes[:2])
        out = torch.empty(shapes[2], dtype=hidden.dtype, device=hidden.device)
        batched.apply(output=out, hidden_states=hidden, w1=e.w13_weight, w2=e.w2_weight,
                      topk_weights=torch.ones((1, top_k), dtype=torch.float32, device=hidden.device), topk_ids=ids,
                      activation=e.activation, global_num_experts=e.global_num_experts, expert_map=None,
                      a1q_scale=None, a2_scale=None, workspace13=ws13, workspace2=ws2,
                      expert_tokens_meta=ExpertTokensMetadata(expert_num_tokens=counts.to(torch.int32),
                                                              expert_num_tokens_cpu=None),
                      apply_router_weight_on_input=False)
        return out
