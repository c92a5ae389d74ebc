"""Cut a step's input tensors by a `SplitPlan`, and stitch the microbatch outputs back together.

Token-dimension tensors are sliced by token range and zero-padded to the plan's padded length (CUDA-graph buckets,
attention TP); per-request values by request range; shared values are passed to every microbatch as they are.
Which key is which must be said: guessing from shapes breaks on the step where tokens equal requests.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from tbo.split.plan import MicrobatchSlice, SplitPlan

__all__ = ["split_inputs", "merge_outputs"]


def _length(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() else None
    if isinstance(value, (list, tuple)):
        return len(value)
    return None


def _pad(piece: Any, to: int, key: str) -> Any:
    missing = to - _length(piece)
    if missing == 0:
        return piece
    if isinstance(piece, torch.Tensor):
        return torch.cat([piece, piece.new_zeros((missing, *piece.shape[1:]))])
    return type(piece)([*piece, *([0] * missing)])


def split_inputs(
    inputs: Mapping[str, Any],
    plan: SplitPlan,
    *,
    request_keys: Iterable[str] = (),
    shared_keys: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """One inputs dict per microbatch. Keys not named as request or shared keys are token-dimension values."""
    request_keys, shared_keys = set(request_keys), set(shared_keys)
    both = request_keys & shared_keys
    if both:
        raise ValueError(f"keys {sorted(both)} are listed as both request and shared keys")
    unknown = (request_keys | shared_keys) - set(inputs)
    if unknown:
        raise ValueError(f"keys {sorted(unknown)} are listed but not in the inputs")
    for key, value in inputs.items():
        if key in shared_keys:
            continue
        expected = plan.num_requests if key in request_keys else plan.num_tokens
        kind = "requests" if key in request_keys else "tokens"
        got = _length(value)
        if got != expected:
            hint = "" if key in request_keys else "; list it in request_keys or shared_keys if it is not per token"
            raise ValueError(
                f"input {key!r} has leading size {got} but the plan has {expected} {kind}{hint}"
            )
    return [_split_one(inputs, mb, request_keys, shared_keys) for mb in plan.microbatches]


def _split_one(inputs: Mapping[str, Any], mb: MicrobatchSlice, request_keys: set, shared_keys: set) -> dict:
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if key in shared_keys:
            out[key] = value
        elif key in request_keys:
            out[key] = value[mb.requests_start : mb.requests_end]
        else:
            out[key] = _pad(value[mb.tokens_start : mb.tokens_end], mb.tokens_len, key)
    return out


def merge_outputs(tensors: Sequence[torch.Tensor], plan: SplitPlan) -> torch.Tensor:
    """Strip each microbatch's padding and concatenate in order: the inverse of `split_inputs` on tokens."""
    if len(tensors) != plan.num_microbatches:
        raise ValueError(f"got {len(tensors)} outputs for a plan of {plan.num_microbatches} microbatches")
    for k, (t, mb) in enumerate(zip(tensors, plan.microbatches)):
        if t.shape[0] not in (mb.tokens_len, mb.tokens_unpadded_len):
            raise ValueError(
                f"microbatch {k} output has {t.shape[0]} rows; expected {mb.tokens_len} (padded) "
                f"or {mb.tokens_unpadded_len}"
            )
    return torch.cat([t[: mb.tokens_unpadded_len] for t, mb in zip(tensors, plan.microbatches)])
