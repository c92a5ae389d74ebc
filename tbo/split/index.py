"""Where to cut a batch into two microbatches: the split-index rules, in plain ints and lists.

Decode-like batches cut between sequences, half the sequences each. Prefill batches cut between sequences too, at the
sequence boundary that best balances tokens, unless that boundary is lopsided (a share below
``token_distribution_threshold``); then the cut falls inside one sequence at half the tokens ("two-chunk" mode), so
that one long prefill still splits in the middle. `boundary_cuts` is the rule for callers that must never cut inside
a sequence: the same boundaries, or no cut at all. A speculative verify step (TARGET_VERIFY) is decode-like: each
request's 1 + k tokens stay whole; when k differs between requests, `verify_cuts` picks the request boundaries that
best balance tokens.
"""

from __future__ import annotations

import enum
from itertools import accumulate
from typing import NamedTuple, Sequence

__all__ = [
    "ForwardMode",
    "Cut",
    "DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD",
    "compute_split_seq_index",
    "compute_split_token_index",
    "boundary_cuts",
    "extend_cut",
    "sequence_lens",
    "verify_cuts",
]

DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD = 0.48


class ForwardMode(enum.Enum):
    """What kind of step a batch is; it decides where the batch may be cut."""

    DECODE = "decode"
    EXTEND = "extend"  #: prefill, possibly mixed with decode requests (extend length 1)
    #: speculative verification: ``token_num_per_seq`` tokens per sequence, or each request's own 1 + k
    #: (``extend_lens``) where the draft count k differs between requests; never cut inside a request
    TARGET_VERIFY = "target_verify"
    IDLE = "idle"

    @property
    def is_decode_like(self) -> bool:
        """Cut only between sequences, each with the same token count."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)

    @classmethod
    def of(cls, mode: "ForwardMode | str") -> "ForwardMode":
        """``mode`` as a ForwardMode: a member as is, or its name or value in any case (``"extend"``, ``"EXTEND"``).

        Frameworks carry the mode as a string often enough that refusing one would only move the conversion into
        every caller; anything else is a TypeError, an unknown name a ValueError listing the known ones.
        """
        if isinstance(mode, cls):
            return mode
        if not isinstance(mode, str):
            raise TypeError(f"mode must be a tbo.ForwardMode or its name as a string, got {type(mode).__name__} "
                            f"{mode!r}")
        try:
            return cls[mode.strip().upper()]
        except KeyError:
            names = ", ".join(m.name for m in cls)
            raise ValueError(f"mode {mode!r} is not a tbo.ForwardMode; expected one of {names} (any case)") from None


class Cut(NamedTuple):
    """A cut of the token stream: the token offset, the sequence it falls at, and whether it falls inside it."""

    token_index: int
    seq_index: int
    inside: bool


def _check_threshold(t: float) -> None:
    if not 0 < t <= 0.5:
        raise ValueError(f"token_distribution_threshold must be in (0, 0.5], got {t}")


def sequence_lens(
    mode: ForwardMode, num_tokens: int, extend_lens: Sequence[int] | None, token_num_per_seq: int
) -> list[int]:
    """Per-sequence token counts, checked against ``num_tokens``; decode-like modes derive them when not given."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if token_num_per_seq < 1:
        raise ValueError(f"token_num_per_seq must be >= 1, got {token_num_per_seq}")
    if mode is ForwardMode.TARGET_VERIFY and extend_lens is not None and token_num_per_seq == 1:
        lens = [int(n) for n in extend_lens]  # each request's 1 + k, k its own draft count
        for i, n in enumerate(lens):
            if n < 1:
                raise ValueError(f"extend_lens[{i}] = {n} in TARGET_VERIFY: a verified request brings at least one "
                                 "token (1 + its draft tokens)")
        if sum(lens) != num_tokens:
            raise ValueError(f"extend_lens sum to {sum(lens)} but num_tokens is {num_tokens}")
        return lens
    if mode.is_decode_like:
        if num_tokens % token_num_per_seq:
            raise ValueError(
                f"num_tokens={num_tokens} is not a multiple of token_num_per_seq={token_num_per_seq} in {mode.name}"
            )
        lens = [token_num_per_seq] * (num_tokens // token_num_per_seq)
        if extend_lens is not None and list(extend_lens) != lens:
            raise ValueError(f"extend_lens in {mode.name} must be {token_num_per_seq} per sequence")
        return lens
    if extend_lens is None:
        if mode is ForwardMode.IDLE:
            return []
        raise ValueError(f"extend_lens is required in {mode.name} mode")
    lens = [int(n) for n in extend_lens]
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"extend_lens[{i}] = {n} is negative")
    if sum(lens) != num_tokens:
        raise ValueError(f"extend_lens sum to {sum(lens)} but num_tokens is {num_tokens}")
    return lens


def extend_cut(extend_lens: Sequence[int], token_distribution_threshold: float) -> Cut | None:
    """The two-microbatch cut of a prefill batch, or None when one side would get no tokens."""
    _check_threshold(token_distribution_threshold)
    total = sum(extend_lens)
    if total == 0:
        return None
    starts = [0, *accumulate(extend_lens)]  # starts[i]: first token of sequence i
    n = len(extend_lens)
    if n >= 2:
        # the boundary closest to balanced; among equal distances, the larger index
        best = max(range(1, n), key=lambda i: (-abs(2 * starts[i] - total), i))
        share = starts[best] / total
        if token_distribution_threshold <= share <= 1 - token_distribution_threshold:
            return Cut(starts[best], best, False)
    half = total // 2  # two-chunk: cut inside the sequence holding token `half`
    if half == 0:
        return None
    seq = next(i for i in range(n) if starts[i + 1] > half)
    return Cut(half, seq, starts[seq] < half)


def boundary_cuts(extend_lens: Sequence[int], parts: int, token_distribution_threshold: float) -> list[Cut] | None:
    """``parts - 1`` cuts between sequences only, or None when no such split is balanced enough.

    Cut ``k`` falls at the sequence boundary closest to ``k * total / parts`` tokens (the larger index on a tie: for
    two parts, the boundary `extend_cut` picks). The split is accepted only if every microbatch gets at least
    ``2 * token_distribution_threshold / parts`` of the tokens, which for two parts is `extend_cut`'s rule: a share
    in ``[t, 1 - t]``. A single sequence, or fewer sequences than parts, never splits.
    """
    _check_threshold(token_distribution_threshold)
    n, total = len(extend_lens), sum(extend_lens)
    if total == 0 or n < parts:
        return None
    starts = [0, *accumulate(extend_lens)]
    cuts = []
    for k in range(1, parts):
        best = max(range(1, n), key=lambda i: (-abs(parts * starts[i] - k * total), i))
        cuts.append(Cut(starts[best], best, False))
    bounds = [0, *(cut.token_index for cut in cuts), total]
    sizes = [end - start for start, end in zip(bounds, bounds[1:])]
    if any(size <= 0 or size * parts < 2 * token_distribution_threshold * total for size in sizes):
        return None
    return cuts


def verify_cuts(lens: Sequence[int], parts: int) -> list[Cut] | None:
    """``parts - 1`` cuts of a verify step between requests only (a request's 1 + k tokens are never cut), or None
    when it has fewer requests than parts.

    Cut ``k`` falls at the request boundary closest to ``k * total / parts`` tokens (the larger index on a tie), each
    microbatch keeping at least one request. Decode-like: no balance threshold, as a decode step's half-and-half cut
    has none. For uniform ``lens`` a caller uses the decode rule (half the requests each) instead.
    """
    n, total = len(lens), sum(lens)
    if n < parts or parts < 2:
        return None
    starts = [0, *accumulate(lens)]
    cuts, prev = [], 0
    for k in range(1, parts):
        candidates = range(prev + 1, n - (parts - k) + 1)  # later microbatches keep a request each
        best = min(candidates, key=lambda i: (abs(parts * starts[i] - k * total), -i))
        cuts.append(Cut(starts[best], best, False))
        prev = best
    return cuts


def _decode_cut(num_seqs: int, token_num_per_seq: int) -> Cut | None:
    seq = num_seqs // 2
    return Cut(seq * token_num_per_seq, seq, False) if seq >= 1 else None


def _cut(
    mode: ForwardMode,
    num_tokens: int,
    extend_lens: Sequence[int] | None,
    token_num_per_seq: int,
    token_distribution_threshold: float,
) -> Cut | None:
    mode = ForwardMode.of(mode)
    if mode is ForwardMode.IDLE:
        return None
    lens = sequence_lens(mode, num_tokens, extend_lens, token_num_per_seq)
    if mode.is_decode_like and len(set(lens)) > 1:  # a verify step whose draft counts differ
        cuts = verify_cuts(lens, 2)
        return None if cuts is None else cuts[0]
    if mode.is_decode_like:
        return _decode_cut(len(lens), lens[0] if lens else token_num_per_seq)
    return extend_cut(lens, token_distribution_threshold)


def compute_split_seq_index(
    mode: ForwardMode | str,
    num_tokens: int,
    extend_lens: Sequence[int] | None = None,
    token_num_per_seq: int = 1,
    *,
    token_distribution_threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD,
) -> int | None:
    """The sequence index where microbatch 1 starts (in two-chunk mode, the sequence that is cut), or None."""
    cut = _cut(mode, num_tokens, extend_lens, token_num_per_seq, token_distribution_threshold)
    return None if cut is None else cut.seq_index


def compute_split_token_index(
    split_seq_index: int,
    mode: ForwardMode | str,
    extend_lens: Sequence[int] | None = None,
    token_num_per_seq: int = 1,
    *,
    token_distribution_threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD,
) -> int:
    """The token offset of the cut for ``split_seq_index``; ``total // 2`` in two-chunk mode."""
    mode = ForwardMode.of(mode)
    if mode is ForwardMode.IDLE:
        return 0
    if mode.is_decode_like:
        if extend_lens is not None:  # a verify step: the requests' own 1 + k
            return sum(sequence_lens(mode, sum(extend_lens), extend_lens, token_num_per_seq)[:split_seq_index])
        return split_seq_index * token_num_per_seq
    if extend_lens is None:
        raise ValueError(f"extend_lens is required in {mode.name} mode")
    cut = extend_cut(extend_lens, token_distribution_threshold)
    if cut is not None and cut.inside and cut.seq_index == split_seq_index:
        return cut.token_index
    return sum(extend_lens[:split_seq_index])
