"""The split decision for one engine step, made by tbo's `SplitPolicy` from vLLM's batch.

A step is ``decode`` (every request past its prompt), ``prefill`` (none is) or ``mixed`` (chunked prefill beside
decodes). The policy sees it as DECODE when every request brings one token, else as EXTEND with each request's
scheduled tokens, so a step can be cut between requests or, when the boundaries are lopsided, inside a prefill
chunk (the later part then attends over the earlier part through the KV cache, which the earlier microbatch's
attention has written by then: microbatch 0 always runs a layer's attention first).

A step does not split when the policy says no, when vLLM's prefix-cache rule forbids it (a request reading blocks
another request of the same step is writing now), when it uses cascade attention, or when the runner padded it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from tbo.split import ForwardMode, SplitPlan, SplitPolicy

__all__ = ["Step", "decide", "microbatch_rows", "ubatch_slices"]


@dataclass(frozen=True)
class Step:
    """One engine step as tbo sees it."""

    mode: str  #: "decode", "prefill" or "mixed"; with data parallelism also "idle" (a dummy step) or "warmup"
    forward_mode: ForwardMode
    num_tokens: int
    plan: SplitPlan | None  #: None: the step runs unsplit
    #: the strategy chosen for it, by the data-parallel ranks' agreement or the adaptive split (None: this step's
    #: own, from its forward mode)
    agreed_strategy: str | None = None
    #: data parallel: what the ranks agreed beyond the plan and the strategy (`tbo.integrations.vllm.dp.DpStep`:
    #: an empty tail, every rank's rows); None: this engine decided alone
    dp: Any = None

    @property
    def strategy_mode(self) -> str:
        """Which strategy runs it: the agreed one, else the decode one for decode-only steps, the prefill one
        otherwise."""
        return self.agreed_strategy if self.agreed_strategy is not None else self.own_strategy

    @property
    def own_strategy(self) -> str:
        """The strategy this step's own batch needs: decode for decode-only steps, prefill otherwise."""
        return "decode" if self.forward_mode is ForwardMode.DECODE else "prefill"

    @property
    def runner_split(self) -> bool:
        """Whether vLLM's runner builds this step in microbatches (the plan's token ranges)."""
        return self.plan is not None and not (self.dp is not None and self.dp.empty_tail)


def decide(policy: SplitPolicy, scheduled: Sequence[int], past_prompt: Sequence[bool], *, allowed: bool,
           padded_tokens: int, cascade: bool = False) -> Step:
    """The `Step` for requests with ``scheduled`` tokens each, ``past_prompt[i]`` True for a decoding request.

    ``allowed`` is False when vLLM's own microbatching veto applies; ``padded_tokens`` is the token count the
    runner will run (a padded step is not split: its microbatches would not be the plan's token ranges).
    ``cascade``: the step uses cascade attention, whose shared-prefix metadata spans every request of the step;
    vLLM's DBO turns it off while microbatching, and a step that has it is not split here. (vLLM 0.32 removed
    cascade attention and always passes False; the veto stays for runners that still pass True.)
    """
    lens = [int(n) for n in scheduled]
    decoding = sum(bool(p) for p in past_prompt)
    mode = "decode" if decoding == len(lens) else "prefill" if decoding == 0 else "mixed"
    num_tokens = sum(lens)
    fmode = ForwardMode.DECODE if all(n == 1 for n in lens) else ForwardMode.EXTEND
    plan = None
    if allowed and not cascade and padded_tokens == num_tokens and len(lens) > 0:
        plan = policy.plan(fmode, num_tokens, None if fmode is ForwardMode.DECODE else lens)
    return Step(mode, fmode, num_tokens, plan)


def microbatch_rows(plan: SplitPlan | None, num_tokens: int, num_microbatches: int) -> tuple[int, ...]:
    """The token rows of each of ``num_microbatches`` microbatches should this step split: ``plan``'s, or (no plan of
    its own) every token in the first and none in the others."""
    if plan is None:
        return (num_tokens,) + (0,) * (num_microbatches - 1)
    return tuple(mb.tokens_end - mb.tokens_start for mb in plan.microbatches)


def ubatch_slices(plan: SplitPlan) -> list[Any]:
    """vLLM's ``UBatchSlice`` for each microbatch of ``plan``: its request range (a cut request in both) and its
    token range. What ``maybe_create_ubatch_slices(..., split_point=plan.split_token_index)`` returns for two
    microbatches, and the plan's own ranges for more (vLLM's helper spaces those evenly)."""
    from vllm.v1.worker.ubatch_utils import UBatchSlice

    return [UBatchSlice(slice(mb.requests_start, mb.requests_end), slice(mb.tokens_start, mb.tokens_end))
            for mb in plan.microbatches]
