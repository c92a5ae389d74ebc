"""Where to cut a batch into two microbatches: the split-index rules, in plain ints and lists.

Decode-like batches cut between sequences, half the sequences each. Prefill batches cut between sequences too, at the
sequence boundary that best balances tokens, unless that boundary is lopsided (a share below
``token_distribution_threshold``); then the cut falls inside one sequence at half the tokens ("two-chunk" mode), so
that one long prefill still splits in the middle.
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
    "extend_cut",
    "sequence_lens",
]

DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD = 0.48


class ForwardMode(enum.Enum):
    """What kind of step a batch is; it decides where the batch may be cut."""

    DECODE = "decode"
    EXTEND = "extend"  #: prefill, possibly mixed with decode requests (extend length 1)
    TARGET_VERIFY = "target_verify"  #: speculative verification, ``token_num_per_seq`` tokens per sequence
    IDLE = "idle"

    @property
    def is_decode_like(self) -> bool:
        """Cut only between sequences, each with the same token count."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


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
    if mode is ForwardMode.IDLE:
        return None
    lens = sequence_lens(mode, num_tokens, extend_lens, token_num_per_seq)
    if mode.is_decode_like:
        return _decode_cut(len(lens), token_num_per_seq)
    return extend_cut(lens, token_distribution_threshold)


def compute_split_seq_index(
    mode: ForwardMode,
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
    mode: ForwardMode,
    extend_lens: Sequence[int] | None = None,
    token_num_per_seq: int = 1,
    *,
    token_distribution_threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD,
) -> int:
    """The token offset of the cut for ``split_seq_index``; ``total // 2`` in two-chunk mode."""
    if mode is ForwardMode.IDLE:
        return 0
    if mode.is_decode_like:
        return split_seq_index * token_num_per_seq
    if extend_lens is None:
        raise ValueError(f"extend_lens is required in {mode.name} mode")
    cut = extend_cut(extend_lens, token_distribution_threshold)
    if cut is not None and cut.inside and cut.seq_index == split_seq_index:
        return cut.token_index
    return sum(extend_lens[:split_seq_index])
