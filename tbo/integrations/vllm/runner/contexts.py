"""Each microbatch's ops run under that microbatch's own vLLM forward context.

vLLM's attention layers find their metadata (query ranges, sequence lengths, block table, slot mapping) in the
current forward context, and its MoE runner finds itself there. On a split step the model runner has built one
context's worth per microbatch (``attn_metadata`` and ``slot_mapping`` are lists); `microbatch_contexts` makes a
context of each with vLLM's own ``create_forward_context``, and `ContextSwitcher`, the executor's `StageHooks`,
enters microbatch k's context (vLLM's ``override_forward_context``) when one of its stages starts and leaves it when
the stage ends (also when an op raised), so the step's own context is current again between stages. Being stage
hooks and not an `Observer`, it keeps a split step on the executor's fast path.
"""

from __future__ import annotations

from typing import Any, Sequence

from tbo.core.stage_hooks import StageHooks
from tbo.split.plan import SplitPlan

__all__ = ["ContextSwitcher", "microbatch_context", "microbatch_contexts"]


def microbatch_contexts(step: Any, plan: SplitPlan, vllm_config: Any) -> list[Any]:
    """One forward context per microbatch of ``plan``, from the step's context ``step`` (which holds lists)."""
    slices = step.ubatch_slices
    got = [(s.token_slice.start, s.token_slice.stop) for s in slices or ()]
    want = [(mb.tokens_start, mb.tokens_end) for mb in plan.microbatches]
    if got != want or not isinstance(step.attn_metadata, list) or len(step.attn_metadata) != len(want):
        raise RuntimeError(f"tbo planned microbatches over tokens {want}, but vLLM's model runner built the step "
                           f"for {got or 'no microbatches'}: the runner's split is not the one tbo decided")
    slot_mapping = step.slot_mapping if isinstance(step.slot_mapping, list) else [None] * len(slices)
    return [microbatch_context(step, step.attn_metadata[k], vllm_config, slot_mapping[k], s.token_slice)
            for k, s in enumerate(slices)]


def microbatch_context(step: Any, attn_metadata: Any, vllm_config: Any, slot_mapping: Any, tokens: slice) -> Any:
    """vLLM's forward context for the microbatch of ``step``'s context over ``tokens``, with its own
    ``attn_metadata`` and ``slot_mapping``; the rest is the step's (no DP metadata: a microbatch is no DP batch)."""
    from vllm.forward_context import create_forward_context

    return create_forward_context(attn_metadata, vllm_config, dp_metadata=None,
                                  cudagraph_runtime_mode=step.cudagraph_runtime_mode,
                                  batch_descriptor=step.batch_descriptor, slot_mapping=slot_mapping,
                                  additional_kwargs=step.additional_kwargs, skip_compiled=step.skip_compiled,
                                  is_padding=None if step.is_padding is None else step.is_padding[tokens])


class ContextSwitcher(StageHooks):
    """Makes microbatch k's forward context current for the duration of each of its stages."""

    def __init__(self, contexts: Sequence[Any]) -> None:
        from vllm.forward_context import override_forward_context

        self._override = override_forward_context
        self.contexts = list(contexts)
        self._active: Any = None

    def enter_stage(self, mb: int, stage: int) -> None:
        active = self._override(self.contexts[mb])
        active.__enter__()
        self._active = active

    def leave_stage(self, mb: int, stage: int) -> None:
        active, self._active = self._active, None
        if active is not None:
            active.__exit__(None, None, None)
