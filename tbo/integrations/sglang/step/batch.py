"""One SGLang ForwardBatch as tbo's `Step`, and its microbatches as SGLang ForwardBatches.

The decision is tbo's: `tbo.integrations.engine.step.decide` (the same rules as in vLLM) over the batch's requests,
each bringing its extend length (one token for a decode). A step the policy does not split, an idle batch, a
speculative one, or one whose tokens the runner padded runs unsplit, through tbo all the same.

The children are SGLang's own: `TboForwardBatchPreparer.filter_batch` slices every per-token and per-request field
of the parent for a token and request range, as SGLang's two-batch overlap does, for any number of microbatches. A
prompt the plan cuts across microbatches (`MicrobatchSlice.prefix_offset`, its share in ``extend_lens``) then gets
its extend and prefix lengths and its sequence length set from the plan: the later part of the prompt attends over
the earlier one through the KV cache, which the earlier microbatch's attention has written by then (microbatch 0
always runs a layer's attention first).
"""

from __future__ import annotations

from typing import Any

import torch

from tbo.integrations.engine.step import Step, decide
from tbo.split import SplitPolicy
from tbo.split.plan import MicrobatchSlice, SplitPlan

__all__ = ["children", "decide_batch"]


def decide_batch(policy: SplitPolicy, fb: Any) -> Step | None:
    """The `Step` for SGLang's ForwardBatch ``fb`` (its plan None where it runs unsplit), or None for a batch tbo does
    not count (idle, speculative, or one SGLang's own two-batch overlap already split)."""
    mode = fb.forward_mode
    if mode.is_idle() or fb.spec_info is not None or fb.tbo_split_seq_index is not None:
        return None
    num_tokens = int(fb.input_ids.shape[0])
    if mode.is_decode():
        lens, past = [1] * fb.batch_size, [True] * fb.batch_size
    elif mode.is_extend() and not mode.is_target_verify() and fb.extend_seq_lens_cpu is not None:
        lens = [int(n) for n in fb.extend_seq_lens_cpu]
        prefix = [int(p) for p in (fb.extend_prefix_lens_cpu or [0] * len(lens))]
        # a request extending by one token past a prefix is a decode in a mixed batch (SGLang's mixed chunk)
        past = [n == 1 and p > 0 for n, p in zip(lens, prefix)] if mode.is_mixed() else [False] * len(lens)
    else:
        return None
    return decide(policy, lens, past, allowed=True, padded_tokens=num_tokens)


def children(fb: Any, plan: SplitPlan) -> list[Any]:
    """The microbatches of ``plan`` as SGLang ForwardBatches, each from SGLang's own ``filter_batch``."""
    from sglang.srt.batch_overlap.two_batch_overlap import TboForwardBatchPreparer

    out = []
    for mb in plan.microbatches:
        n = mb.tokens_end - mb.tokens_start
        child = TboForwardBatchPreparer.filter_batch(
            fb, start_token_index=mb.tokens_start, end_token_index=mb.tokens_end,
            start_seq_index=mb.requests_start, end_seq_index=mb.requests_end,
            out_num_token_non_padded=torch.tensor(n, dtype=torch.int32, device=fb.input_ids.device),
            out_num_token_non_padded_cpu=n)
        if fb.forward_mode.is_extend() and fb.extend_seq_lens_cpu is not None:
            _set_extend_lengths(child, mb)
        out.append(child)
    return out


def _set_extend_lengths(child: Any, mb: MicrobatchSlice) -> None:
    """A child's extend, prefix and sequence lengths from the plan: a request cut by the plan brings only its share
    of tokens, and its later share a prefix grown by the earlier share (what the KV cache holds by then)."""
    extend = [int(n) for n in mb.extend_lens]
    prefix = [int(p) for p in child.extend_prefix_lens_cpu]
    prefix[0] += int(mb.prefix_offset)
    seq = [p + e for p, e in zip(prefix, extend)]
    if extend == [int(n) for n in child.extend_seq_lens_cpu] and not mb.prefix_offset:
        return  # no request of this microbatch was cut: filter_batch's slices are right
    device = child.input_ids.device
    lens = torch.tensor(extend, dtype=child.extend_seq_lens.dtype, device=device)
    child.extend_seq_lens_cpu, child.extend_prefix_lens_cpu = extend, prefix
    child.extend_seq_lens = lens
    child.extend_prefix_lens = torch.tensor(prefix, dtype=child.extend_prefix_lens.dtype, device=device)
    child.seq_lens = torch.tensor(seq, dtype=child.seq_lens.dtype, device=device)
    child.seq_lens_cpu = torch.tensor(seq, dtype=child.seq_lens_cpu.dtype)
    child.seq_lens_sum = int(sum(seq))
    child.extend_num_tokens = int(sum(extend))
    child.extend_start_loc = torch.cumsum(lens, 0) - lens
