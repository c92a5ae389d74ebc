"""Quantized MoE checkpoints: what tbo admits, and how its experts op calls the layer's own quant method.

vLLM 0.32 gives every MoE layer a ``RoutedExperts`` whose ``quant_method`` (unquantized, FP8, GPTQ / AWQ /
compressed-tensors int4, MXFP4, ...) owns the expert math. A modular method's ``moe_kernel`` is a ``FusedMoEKernel``:
a prepare/finalize step (the input's quantisation; vLLM's own all-to-all) around a ``fused_experts`` object that holds
the weights' scales and zero points in its ``quant_config``, and every modular method's ``apply`` is
``moe_kernel.apply(x, layer.w13_weight, layer.w2_weight, ...)``. tbo's experts op calls that method (one rank:
``forward_modular``; data parallel + expert parallel: its ``fused_experts`` behind vLLM's no-communication prepare,
on the rows this rank received), so the math is the quant method's, whichever it is. What that takes per call,
beyond the tokens, is `ExpertsCall`:

* the method's lazily built ``moe_quant_config`` (``_ensure_moe_quant_config_init``, which vLLM's runner calls before
  every forward and tbo's ops, bypassing the runner, call too);
* the rows padded to the kernel's hidden size where the method rounds it up (MXFP4 backends turn GPT-OSS's 2880 into
  3072: ``moe_config.hidden_dim``), and the output cut back to the model's, as the runner's
  ``_maybe_pad_hidden_states`` and its final truncation do;
* with FP8 dispatch (`fp8_refusal`, `fp8_dispatch_for`), the rows quantised *before* the dispatch by the method's own
  quantiser (vLLM's ``moe_kernel_quantize_input`` under its ``quant_config``: DeepSeek's block FP8 takes per-token
  groups of 128), sent with their scales over DeepEP, and handed to ``fused_experts`` as ``a1q`` / ``a1q_scale``,
  skipping the prepare step's quantisation, as vLLM's own DeepEP high-throughput prepare does. Per token group, the
  quantisation of a row does not depend on the other rows, so the kernel sees the bits it would have made itself.

What cannot work is refused at load, naming the layer (`kernel_problems`): a monolithic kernel, which takes the
router logits and routes inside (tbo needs the top-k before the dispatch); and, under expert parallelism, a method
without a modular kernel or whose experts take the batched layout (vLLM's DeepEP low-latency all-to-all). A method
quantising its activations with one dynamic scale per call (per-tensor FP8 or INT8) is admitted with a warning: each
microbatch then gets its own scale, as under vLLM's own DBO, so split and unsplit steps agree to that rounding, not
bit for bit (`batch_dependent_scales`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tbo.integrations.vllm.errors import TboConfigError, config_error

__all__ = ["ExpertsCall", "batch_dependent_scales", "fp8_dispatch_for", "fp8_refusal",
           "fused_experts_of", "kernel_problems", "standard_kernel"]

#: the activation group DeepEP's FP8 dispatch carries one float32 scale for (DeepSeek's block FP8: [128, 128])
FP8_GROUP = 128
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def fused_experts_of(experts: Any) -> Any:
    """The quant method's modular ``fused_experts`` (None: it has no modular kernel): where every check of this room
    reads the kernel tbo calls."""
    impl = getattr(getattr(experts.quant_method, "moe_kernel", None), "impl", None)
    fused = getattr(impl, "fused_experts", None)
    return fused if fused is not None and hasattr(impl, "prepare_finalize") else None


def standard_kernel(experts: Any) -> Any:
    """vLLM's experts kernel of the MoE ``experts`` (a ``RoutedExperts``) behind the prepare/finalize that moves
    nothing (``MoEPrepareAndFinalizeNoDPEPModular``): the NORMAL-layout kernel tbo calls on tokens it already moved.
    Raises `TboConfigError` when the layer's MoE method has no modular kernel."""
    fused = fused_experts_of(experts)
    if fused is None:
        raise TboConfigError(f"the MoE method {type(experts.quant_method).__name__} has no modular experts kernel "
                             "for tbo to call on the tokens it received")
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    return FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), fused)


def _kernel_name(experts: Any) -> str:
    """The quant method and its experts class, module-qualified (vLLM has two ``CPUExpertsInt4``: Arm's monolithic
    one in ``cpu_int4_moe``, x86's modular one in ``cpu_moe``)."""
    method = experts.quant_method
    kernel = getattr(method, "moe_kernel", None)
    cls = type(kernel.fused_experts) if kernel is not None else getattr(method, "experts_cls", None)
    return f"{type(method).__name__}" + (f" with {cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"
                                         if cls is not None else "")


def kernel_problems(experts: Any, expert_parallel: bool) -> list[str]:
    """What of this layer's quant method (``experts``: its ``RoutedExperts``) tbo's experts op cannot call."""
    method = experts.quant_method
    if method.is_monolithic:
        return [f"a monolithic MoE kernel ({_kernel_name(experts)}: it takes the router logits and routes inside "
                "the kernel; tbo needs the top-k before the dispatch)"]
    if not expert_parallel:
        return []
    fused = fused_experts_of(experts)
    if fused is None:
        return [f"no modular experts kernel ({type(method).__name__} has no moe_kernel for tbo to call on the "
                "tokens it received)"]
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEActivationFormat

    if fused.activation_format() != FusedMoEActivationFormat.Standard:
        return [f"an experts kernel taking the batched layout ({_kernel_name(experts)}: vLLM builds it for its "
                "DeepEP low-latency all2all_backend; tbo dispatches each token once with its top-k, the standard "
                "layout: leave all2all_backend at its default)"]
    return []


def fp8_refusal(experts: Any) -> str | None:
    """None when this layer's experts take FP8 rows in per-token groups of 128 with their float32 scales (the block
    FP8 of DeepSeek's checkpoints: what DeepEP's FP8 dispatch carries, `ExpertsCall.quantize`); else why not."""
    fused = fused_experts_of(experts)
    if fused is None:
        return f"{type(experts.quant_method).__name__} has no modular experts kernel to hand FP8 rows"
    if fused.expects_unquantized_inputs:
        return f"its kernel ({_kernel_name(experts)}) takes unquantised rows and quantises them itself"
    qc = fused.quant_config
    if qc.quant_dtype not in _FP8_DTYPES:
        return f"its activations are {'not quantised' if qc.quant_dtype is None else qc.quant_dtype}, not FP8"
    if qc.block_shape is None or qc.block_shape[1] != FP8_GROUP or qc.per_act_token_quant or qc.a1_scale is not None:
        return (f"its FP8 activations are not in per-token groups of {FP8_GROUP} with dynamic scales (block_shape "
                f"{qc.block_shape}, per_act_token_quant {qc.per_act_token_quant}, static scale "
                f"{qc.a1_scale is not None}); DeepSeek's block FP8 ([128, 128]) is")
    if experts.apply_router_weight_on_input:
        return "its router weights are applied to its input before the kernel"
    return None


def fp8_dispatch_for(layers: list[tuple[int, Any]], setting: bool | str) -> bool:
    """Whether the dispatch carries FP8 rows with their scales: ``setting`` (``fp8_dispatch``) True requires every
    MoE layer's experts to take them (`fp8_refusal`; a `TboConfigError` names the first that does not), "auto"
    turns it on where they all do, False never. ``layers``: ``(index, RoutedExperts)`` of each MoE layer. (Whether
    the backend carries FP8 is checked at engine start: `check_quantization`.)"""
    if setting is False or not layers:
        return False
    for idx, experts in layers:
        why = fp8_refusal(experts)
        if why is not None:
            if setting is True:
                raise config_error({"fp8_dispatch": True}, f"layer {idx}'s experts do not take FP8 rows ({why}); "
                                   "accepted: 'auto' or False for this checkpoint")
            return False
    return True


def batch_dependent_scales(experts: Any) -> bool:
    """Whether the quant method's prepare step quantises the activations with one dynamic scale per call (per-tensor
    FP8 or INT8): a row's quantised bits then depend on the other rows of the call (see the module docstring)."""
    fused = fused_experts_of(experts)
    if fused is None or fused.expects_unquantized_inputs:
        return False
    qc = fused.quant_config
    return (qc.quant_dtype in (*_FP8_DTYPES, torch.int8) and qc.a1_scale is None and not qc.per_act_token_quant
            and qc.block_shape is None)



class ExpertsCall:
    """One MoE layer's experts as tbo's experts op calls them, through the layer's quant method (see the module
    docstring): ``local`` on one rank, ``received`` on the rows a data-parallel rank received, each with FP8 rows
    and their scales where ``fp8``."""

    def __init__(self, experts: Any, *, hidden_dim: int | None = None, unpadded_dim: int | None = None,
                 fp8: bool = False, kernel: Any = None) -> None:
        self.experts, self.fp8 = experts, fp8
        #: the quantiser of FP8 rows; None: vLLM's ``moe_kernel_quantize_input`` (a Triton kernel: the CPU tests put
        #: a torch stand-in with its signature here)
        self.quantizer: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None
        #: pad the rows to this width before the kernel (None: the kernel takes the model's width)
        self.pad_to = hidden_dim if hidden_dim is not None and hidden_dim != unpadded_dim else None
        self.unpadded_dim = unpadded_dim
        #: vLLM's experts kernel behind its no-communication prepare/finalize (expert parallelism, FP8 rows)
        self.kernel = kernel

    @classmethod
    def of(cls, runner: Any, *, fp8: bool = False, expert_parallel: bool = False) -> "ExpertsCall":
        """The call of ``runner``'s (a ``MoERunner``'s) experts; ``kernel`` built where it is needed."""
        experts, moe = runner.routed_experts, runner.moe_config
        unpadded = getattr(moe, "hidden_dim_unpadded", None) or moe.hidden_dim
        pads = moe.hidden_dim != unpadded and not experts.quant_method.skip_forward_padding
        kernel = None
        if fp8 or expert_parallel:
            # vLLM's experts kernel as it is, behind the prepare/finalize that moves nothing: its own (naive DP/EP:
            # all_gatherv, reduce_scatter) would move the tokens a second time, and does not run on a CPU
            kernel = standard_kernel(experts)
        return cls(experts, hidden_dim=moe.hidden_dim if pads else None, unpadded_dim=unpadded, fp8=fp8,
                   kernel=kernel)

    # ---- the per-call state ------------------------------------------------------------------------------------
    def pad(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad_to is None or x.shape[-1] == self.pad_to:
            return x
        return torch.nn.functional.pad(x, (0, self.pad_to - x.shape[-1]))

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.pad_to is None or out.shape[-1] == self.unpadded_dim else out[..., :self.unpadded_dim]

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (padded) as FP8 rows and their scales, by the quant method's own quantiser and ``quant_config``."""
        qc = fused_experts_of(self.experts).quant_config
        x = self.pad(x)
        if x.shape[0] == 0:  # a data-parallel rank's empty microbatch still dispatches: no kernel runs on no rows
            return (torch.empty(x.shape, dtype=qc.quant_dtype, device=x.device),
                    torch.empty((0, x.shape[1] // FP8_GROUP), dtype=torch.float32, device=x.device))
        quantize = self.quantizer
        if quantize is None:
            from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input as quantize
        q, scales = quantize(x, qc.a1_scale, quant_dtype=qc.quant_dtype, per_act_token_quant=qc.per_act_token_quant,
                             block_shape=qc.block_shape)
        return q, scales

    # ---- the calls ---------------------------------------------------------------------------------------------
    def local(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              scales: torch.Tensor | None = None) -> torch.Tensor:
        """Every expert on this rank (global ids): the quant method's ``forward_modular``, or its kernel on FP8
        rows with ``scales``."""
        experts = self.experts
        experts._ensure_moe_quant_config_init()
        if scales is not None:
            return self._quantized(x, scales, ids, weights, experts.global_num_experts, experts.expert_map)
        return self.unpad(experts.forward_modular(x=self.pad(x), topk_weights=weights, topk_ids=ids))

    def received(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 scales: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's experts on the rows it received (local ids, every slot local: `ep.run_local_experts`)."""
        experts = self.experts
        if scales is not None:
            return self._quantized(x, scales, ids, weights, experts.local_num_experts, None)
        return self.unpad(self.kernel.apply(
            hidden_states=self.pad(x), w1=experts.w13_weight, w2=experts.w2_weight, topk_ids=ids,
            topk_weights=weights, activation=experts.activation, global_num_experts=experts.local_num_experts,
            expert_map=None, apply_router_weight_on_input=experts.apply_router_weight_on_input))

    def _quantized(self, q: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   num_experts: int, expert_map: torch.Tensor | None) -> torch.Tensor:
        """vLLM's modular kernel from its experts step on: ``fused_experts.apply`` on the FP8 rows with their scales
        (``a1q``, ``a1q_scale``), then the finalize step's weighted top-k reduction, as
        ``FusedMoEKernelModularImpl.apply`` runs them after its prepare step."""
        experts, impl = self.experts, self.kernel.impl
        dtype = experts.moe_config.in_dtype
        fused = impl._fused_experts(
            in_dtype=dtype, a1q=q, a1q_scale=scales, w1=experts.w13_weight, w2=experts.w2_weight,
            topk_weights=weights, topk_ids=ids, activation=experts.activation, global_num_experts=num_experts,
            local_num_experts=experts.w13_weight.shape[0], expert_map=expert_map, apply_router_weight_on_input=False,
            expert_tokens_meta=None)
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        return self.unpad(impl._finalize(out, fused, q, weights, ids, False, shared_experts=None,
                                         shared_experts_input=None))
