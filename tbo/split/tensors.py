"""Cut a step's input tensors by a `SplitPlan`, and stitch the microbatch outputs back together.

Token-dimension tensors are sliced by token range and zero-padded to the plan's padded length (CUDA-graph buckets,
attention TP); per-request values by request range; shared values are passed to every microbatch as they are.
Which key is which must be said: guessing from shapes breaks on the step where tokens equal requests.

A plan may cut a request in two ("two-chunk" prefill). That request then appears in both microbatches, each holding
part of its tokens, and a per-request value that counts tokens is wrong in both if merely sliced: the splitting page's
``[10, 90]`` cut at 50 tokens would give microbatch 0 ``[10, 90]`` and microbatch 1 ``[90]``. So every per-request
key says what it means (`RequestRule`): a length kind is rewritten for each part, a whole-request property is
copied, a callable decides, and a key that says nothing ("opaque") is refused on a cut rather than sliced wrongly.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Literal, Mapping, Sequence, Union

import torch

from tbo.split.plan import MicrobatchSlice, SplitPlan

__all__ = ["REQUEST_KINDS", "RequestRule", "split_inputs", "merge_outputs"]

#: What a per-request value means, for the request that a cut splits between microbatches.
REQUEST_KINDS: dict[str, str] = {
    "opaque": "unknown: sliced by request on an uncut plan, refused when a plan cuts a sequence",
    "request": "a property of the whole request (an id, a cache slot, a sampling parameter): each part gets it",
    "lengths": "this step's tokens of each request (extend lengths): each part gets its share",
    "prefix_lens": "tokens each request had before this step (cached prefix): a later part adds the earlier parts'",
    "total_lens": "prefix plus this step's tokens (SGLang's seq_lens): each part counts up to its own last token",
}

#: A kind from `REQUEST_KINDS`, or ``rule(value, slice) -> value`` called for every microbatch's slice.
RequestRule = Union[Literal["opaque", "request", "lengths", "prefix_lens", "total_lens"],
                    Callable[[Any, MicrobatchSlice], Any]]

#: For each arithmetic kind: the coefficients of (tokens of the request held by earlier microbatches, tokens held by
#: later ones) added to the request's value. The first request of a slice is the only one with earlier tokens, the
#: last the only one with later tokens.
_ADJUST = {"request": (0, 0), "lengths": (-1, -1), "prefix_lens": (1, 0), "total_lens": (0, -1)}


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


def _rules(request_keys: Iterable[str] | Mapping[str, RequestRule]) -> dict[str, RequestRule]:
    if isinstance(request_keys, str):
        raise TypeError(f"request_keys must be a list of keys or a mapping key -> rule, got the string "
                        f"{request_keys!r}")
    if not isinstance(request_keys, Mapping):
        return {key: "opaque" for key in request_keys}
    rules = dict(request_keys)
    for key, rule in rules.items():
        if isinstance(rule, str):
            if rule not in REQUEST_KINDS:
                raise ValueError(f"request key {key!r} has kind {rule!r}; the kinds are {', '.join(REQUEST_KINDS)}, "
                                 "or a callable (value, slice) -> value")
        elif not callable(rule):
            raise TypeError(f"request key {key!r} has rule {rule!r} ({type(rule).__name__}); expected a kind "
                            f"({', '.join(REQUEST_KINDS)}) or a callable (value, slice) -> value")
    return rules


def _describe_cut(plan: SplitPlan) -> str:
    k, cut = next((k, cut) for k, cut in enumerate(plan.cuts) if cut.inside)
    left, right = plan.microbatches[k].extend_lens[-1], plan.microbatches[k + 1].extend_lens[0]
    return f"request {cut.seq_index} ({left} tokens in microbatch {k}, {right} in microbatch {k + 1})"


def _on_host(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) or value.device.type == "cpu"


def _check_lengths(key: str, kind: str, value: Any, lens: Sequence[int]) -> None:
    """Catch a key declared with the wrong length kind, where reading it costs no device sync."""
    if not _on_host(value):
        return  # a device tensor is not read back: that would stall the step on every call
    values = value.tolist() if isinstance(value, torch.Tensor) else list(value)
    if kind == "lengths" and values != list(lens):
        raise ValueError(f"request key {key!r} is declared 'lengths' but holds {values[:8]}"
                         f"{' ...' if len(values) > 8 else ''} where the plan's extend lengths are {list(lens[:8])}"
                         f"{' ...' if len(lens) > 8 else ''}; if it counts cached tokens too, declare it "
                         "'total_lens'")
    if kind == "total_lens":
        short = [r for r, (v, n) in enumerate(zip(values, lens)) if v < n]
        if short:
            r = short[0]
            raise ValueError(f"request key {key!r} is declared 'total_lens' but request {r} has {values[r]}, fewer "
                             f"than its {lens[r]} tokens in this step")
    if kind == "prefix_lens":
        negative = [r for r, v in enumerate(values) if v < 0]
        if negative:
            raise ValueError(f"request key {key!r} is declared 'prefix_lens' but request {negative[0]} has "
                             f"{values[negative[0]]}")


def split_inputs(
    inputs: Mapping[str, Any],
    plan: SplitPlan | None,
    *,
    request_keys: Iterable[str] | Mapping[str, RequestRule] = (),
    shared_keys: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """One inputs dict per microbatch. Keys not named as request or shared keys are token-dimension values.

    ``request_keys`` maps each per-request key to its `RequestRule`: ``{"extend_lens": "lengths", "req_ids":
    "request"}``. A plain list of keys declares them all ``"opaque"``, which is fine until a plan cuts a sequence,
    and then raises `ValueError` naming the key and the cut, instead of handing out wrong values.

    ``plan=None`` (the policy's answer for a step too small to split) passes the inputs through as one microbatch,
    ``[dict(inputs)]``, so one code path serves split and unsplit steps; `merge_outputs` takes ``None`` likewise.
    """
    if not isinstance(inputs, Mapping):
        raise TypeError(f"inputs must be a dict of named values, got {type(inputs).__name__}")
    if plan is not None and not isinstance(plan, SplitPlan):
        raise TypeError(f"plan must be a tbo.SplitPlan or None (run unsplit), got {type(plan).__name__}")
    rules, shared_keys = _rules(request_keys), set(shared_keys)
    both = set(rules) & shared_keys
    if both:
        raise ValueError(f"keys {sorted(both)} are listed as both request and shared keys")
    unknown = (set(rules) | shared_keys) - set(inputs)
    if unknown:
        raise ValueError(f"keys {sorted(unknown)} are listed but not in the inputs")
    if plan is None:
        return [dict(inputs)]
    for key, value in inputs.items():
        if key in shared_keys:
            continue
        expected = plan.num_requests if key in rules else plan.num_tokens
        kind = "requests" if key in rules else "tokens"
        got = _length(value)
        if got != expected:
            hint = "" if key in rules else "; list it in request_keys or shared_keys if it is not per token"
            raise ValueError(
                f"input {key!r} has leading size {got} but the plan has {expected} {kind}{hint}"
            )
    lens = plan.extend_lens
    if plan.two_chunk:
        opaque = sorted(key for key, rule in rules.items() if rule == "opaque")
        if opaque:
            raise ValueError(
                f"request key {opaque[0]!r} has no rule for a cut sequence, and this plan cuts "
                f"{_describe_cut(plan)}: slicing would give both microbatches that request's whole value. Declare "
                f"what it is, e.g. request_keys={{{opaque[0]!r}: 'lengths'}}; the kinds: "
                + "; ".join(f"{kind!r}: {meaning}" for kind, meaning in REQUEST_KINDS.items() if kind != "opaque")
                + "; or a callable (value, slice) -> value. Or plan with SplitPolicy(allow_cut_sequences=False)."
            )
    for key, rule in rules.items():
        if isinstance(rule, str) and rule in ("lengths", "prefix_lens", "total_lens"):
            _check_lengths(key, rule, inputs[key], lens)
    return [_split_one(inputs, mb, rules, shared_keys, lens) for mb in plan.microbatches]


def _split_requests(value: Any, mb: MicrobatchSlice, rule: RequestRule, lens: Sequence[int]) -> Any:
    if callable(rule):
        return rule(value, mb)
    piece = value[mb.requests_start : mb.requests_end]
    if rule == "opaque" or not mb.requests_len:
        return piece
    c_before, c_after = _ADJUST[rule]
    last = mb.requests_end - 1
    before = mb.prefix_offset  # tokens of the first request held by earlier microbatches
    after = lens[last] - mb.extend_lens[-1] - (before if mb.requests_len == 1 else 0)  # by later ones
    first_delta, last_delta = c_before * before, c_after * after
    if not first_delta and not last_delta:
        return piece
    if isinstance(piece, torch.Tensor):
        piece = piece.clone()
    else:
        piece = list(piece)
    piece[0] += first_delta
    piece[-1] += last_delta
    return piece if isinstance(piece, torch.Tensor) else type(value)(piece)


def _split_one(inputs: Mapping[str, Any], mb: MicrobatchSlice, rules: Mapping[str, RequestRule], shared_keys: set,
               lens: Sequence[int]) -> dict:
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if key in shared_keys:
            out[key] = value
        elif key in rules:
            out[key] = _split_requests(value, mb, rules[key], lens)
        else:
            out[key] = _pad(value[mb.tokens_start : mb.tokens_end], mb.tokens_len, key)
    return out


def merge_outputs(tensors: Sequence[torch.Tensor], plan: SplitPlan | None) -> torch.Tensor:
    """Strip each microbatch's padding and concatenate in order: the inverse of `split_inputs` on tokens.

    With ``plan=None`` (an unsplit step) there must be exactly one output, returned as it is."""
    if plan is not None and not isinstance(plan, SplitPlan):
        raise TypeError(f"plan must be a tbo.SplitPlan or None (an unsplit step), got {type(plan).__name__}")
    count = 1 if plan is None else plan.num_microbatches
    if len(tensors) != count:
        raise ValueError(f"got {len(tensors)} outputs for a plan of {count} microbatch{'es' * (count != 1)}")
    if plan is None:
        return tensors[0]
    for k, (t, mb) in enumerate(zip(tensors, plan.microbatches)):
        if t.shape[0] not in (mb.tokens_len, mb.tokens_unpadded_len):
            raise ValueError(
                f"microbatch {k} output has {t.shape[0]} rows; expected {mb.tokens_len} (padded) "
                f"or {mb.tokens_unpadded_len}"
            )
    return torch.cat([t[: mb.tokens_unpadded_len] for t, mb in zip(tensors, plan.microbatches)])
