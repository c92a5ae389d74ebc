"""`SplitPolicy` decides whether and where a step splits; `SplitPlan` describes the microbatches it makes.

The plan is plain data: per microbatch, its token and request ranges, padded and unpadded lengths, microbatch index and
count. These are the fields an attention-FFN connector puts on the wire and the fields ops read from their State.
Thresholds live here and nowhere else: a step too small to gain from overlap gets no plan, and runs unsplit.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tbo.core.state import State
from tbo.split.index import (DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD, Cut, ForwardMode, _decode_cut, boundary_cuts,
                             extend_cut, sequence_lens, verify_cuts)

__all__ = ["MicrobatchSlice", "SplitPlan", "SplitPolicy", "plan_from_cuts"]


@dataclass(frozen=True)
class MicrobatchSlice:
    """One microbatch of a split step.

    ``extend_lens`` are this microbatch's share of each of its requests; a request cut in two appears in both
    microbatches. ``prefix_offset`` is how many tokens of the first request earlier microbatches already hold: its
    cached prefix for attention (0 unless the request was cut).
    """

    microbatch_idx: int
    num_microbatches: int
    tokens_start: int
    tokens_len: int
    tokens_unpadded_len: int
    requests_start: int
    requests_len: int
    extend_lens: tuple[int, ...]
    prefix_offset: int

    @property
    def tokens_end(self) -> int:
        return self.tokens_start + self.tokens_unpadded_len

    @property
    def requests_end(self) -> int:
        return self.requests_start + self.requests_len

    @property
    def padding(self) -> int:
        return self.tokens_len - self.tokens_unpadded_len


@dataclass(frozen=True)
class SplitPlan:
    """How one step's batch is cut into microbatches."""

    mode: ForwardMode
    num_tokens: int
    num_requests: int
    microbatches: tuple[MicrobatchSlice, ...]
    cuts: tuple[Cut, ...]

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    @property
    def two_chunk(self) -> bool:
        """True when a cut falls inside a sequence (the sequence is processed in two chunks)."""
        return any(cut.inside for cut in self.cuts)

    @property
    def split_seq_index(self) -> int:
        """The first cut's sequence index: where microbatch 1 starts (or the cut sequence in two-chunk mode)."""
        return self.cuts[0].seq_index

    @property
    def split_token_index(self) -> int:
        return self.cuts[0].token_index

    @property
    def extend_lens(self) -> tuple[int, ...]:
        """Each request's tokens in the whole step (the sum of its shares over the microbatches)."""
        lens = [0] * self.num_requests
        for mb in self.microbatches:
            for j, share in enumerate(mb.extend_lens):
                lens[mb.requests_start + j] += share
        return tuple(lens)

    @property
    def cut_extend_lens(self) -> tuple[int, int] | None:
        """Two-chunk mode: the cut sequence's extend length in the first and the second microbatch."""
        if not self.cuts[0].inside:
            return None
        return self.microbatches[0].extend_lens[-1], self.microbatches[1].extend_lens[0]

    def make_states(self, **extra: Any) -> list[State]:
        """One State per microbatch, pinned with ``microbatch_idx``, ``num_microbatches`` and ``split`` (its slice)."""
        states = []
        for mb in self.microbatches:
            state = State()
            state.pin(microbatch_idx=mb.microbatch_idx, num_microbatches=mb.num_microbatches, split=mb, **extra)
            states.append(state)
        return states


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_from_cuts(
    mode: ForwardMode, lens: Sequence[int], cuts: Sequence[Cut], pad_to_multiple: int = 1
) -> SplitPlan:
    """Derive every microbatch's ranges from the cuts of the token stream (``len(cuts) + 1`` microbatches)."""
    mode = ForwardMode.of(mode)
    starts = [0, *accumulate(lens)]
    total, n = starts[-1], len(lens)
    bounds = [Cut(0, 0, False), *cuts]
    count = len(bounds)
    slices = []
    for k, cut in enumerate(bounds):
        token_end = cuts[k].token_index if k < len(cuts) else total
        if k + 1 < count:
            nxt = bounds[k + 1]
            req_end = nxt.seq_index + (1 if nxt.inside else 0)
        else:
            req_end = n
        req_start = cut.seq_index
        shares = tuple(
            max(0, min(starts[i + 1], token_end) - max(starts[i], cut.token_index)) for i in range(req_start, req_end)
        )
        unpadded = token_end - cut.token_index
        slices.append(
            MicrobatchSlice(
                microbatch_idx=k,
                num_microbatches=count,
                tokens_start=cut.token_index,
                tokens_len=_round_up(unpadded, pad_to_multiple),
                tokens_unpadded_len=unpadded,
                requests_start=req_start,
                requests_len=req_end - req_start,
                extend_lens=shares,
                prefix_offset=cut.token_index - starts[req_start] if req_start < n else 0,
            )
        )
    return SplitPlan(mode=mode, num_tokens=total, num_requests=n, microbatches=tuple(slices), cuts=tuple(cuts))


def _cut_at_token(starts: Sequence[int], token: int) -> Cut:
    seq = next(i for i in range(len(starts) - 1) if starts[i + 1] > token)
    return Cut(token, seq, starts[seq] < token)


#: A prefill step splits from this many tokens per microbatch by default (12 for two: the AFD recipe's threshold).
PREFILL_TOKENS_PER_MICROBATCH = 6


class SplitPolicy(BaseModel):
    """When to split a step, into how many microbatches, and how to pad them.

    A decode-only step splits when it has at least ``decode_token_threshold`` tokens; a step with any prefill when it
    has at least ``prefill_token_threshold``. The defaults follow ``num_microbatches``: decode from one token per
    microbatch, prefill from six per microbatch; for two microbatches, the AFD recipe's (decode 2, prefill 12).

    By default a prefill step whose sequence boundaries are all lopsided is cut inside a sequence ("two-chunk"), so
    that one long prefill still overlaps. That needs attention that reads the cut request's earlier tokens from the
    KV cache, and per-request inputs split by their meaning (`split_inputs` ``request_keys``). A framework whose
    attention cannot do that sets ``allow_cut_sequences=False``: cuts fall between sequences only, and a step with
    no acceptable boundary runs unsplit.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_microbatches: int = Field(default=2, description="microbatches per split step")
    decode_token_threshold: int = Field(
        default=2, description="a decode-only step splits from this many tokens (default: num_microbatches)")
    prefill_token_threshold: int = Field(
        default=12, description="a step with prefill splits from this many tokens (default: 6 x num_microbatches)")
    token_distribution_threshold: float = Field(
        default=DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD,
        description="below this share on one side of a sequence boundary, cut inside a sequence instead",
    )
    pad_to_multiple: int = Field(default=1, description="pad each microbatch's tokens to a multiple of this")
    allow_cut_sequences: bool = Field(
        default=True,
        description="False: never cut inside a sequence; a step with no balanced sequence boundary runs unsplit",
    )

    @model_validator(mode="before")
    @classmethod
    def _follow_num_microbatches(cls, data: Any) -> Any:
        """Unset thresholds follow the microbatch count, so that ``SplitPolicy(num_microbatches=3)`` is valid."""
        if isinstance(data, Mapping) and "num_microbatches" in data:
            try:
                n = int(data["num_microbatches"])
            except (TypeError, ValueError):
                return data  # the field's own validation names it
            data = dict(data)
            data.setdefault("decode_token_threshold", n)
            data.setdefault("prefill_token_threshold", PREFILL_TOKENS_PER_MICROBATCH * n)
        return data

    @model_validator(mode="after")
    def _check(self) -> "SplitPolicy":
        if self.num_microbatches < 2:
            raise ValueError(f"num_microbatches must be >= 2, got {self.num_microbatches}")
        for field in ("decode_token_threshold", "prefill_token_threshold"):
            if getattr(self, field) < self.num_microbatches:
                raise ValueError(
                    f"{field}={getattr(self, field)} is lower than num_microbatches={self.num_microbatches}: "
                    "a step that small cannot give every microbatch a token"
                )
        if not 0 < self.token_distribution_threshold <= 0.5:
            raise ValueError(
                f"token_distribution_threshold must be in (0, 0.5], got {self.token_distribution_threshold}"
            )
        if self.pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple must be >= 1, got {self.pad_to_multiple}")
        return self

    def threshold_for(self, mode: ForwardMode | str, lens: Sequence[int]) -> int:
        """The token count from which a step of this mode and these sequence lengths splits."""
        has_prefill = ForwardMode.of(mode) is ForwardMode.EXTEND and any(n > 1 for n in lens)
        return self.prefill_token_threshold if has_prefill else self.decode_token_threshold

    def plan(
        self,
        mode: ForwardMode | str,
        num_tokens: int,
        extend_lens: Sequence[int] | None = None,
        token_num_per_seq: int = 1,
    ) -> SplitPlan | None:
        """The split plan for this step, or None: run it unsplit (too small, IDLE, or no acceptable cut exists).

        ``mode`` is a `ForwardMode` or its name in any case (``"extend"``). A TARGET_VERIFY step gives either
        ``token_num_per_seq`` (every request 1 + k tokens) or ``extend_lens`` (each request's own 1 + k, where k
        varies); its cuts fall between requests only, with the decode threshold.
        """
        mode = ForwardMode.of(mode)
        if mode is ForwardMode.IDLE:
            return None
        if mode.is_decode_like and extend_lens is None:
            return self._uniform_plan(mode, num_tokens, token_num_per_seq)
        lens = sequence_lens(mode, num_tokens, extend_lens, token_num_per_seq)
        if num_tokens < self.threshold_for(mode, lens):
            return None
        cuts = self._cuts(mode, lens, token_num_per_seq)
        if cuts is None:
            return None
        return plan_from_cuts(mode, lens, cuts, self.pad_to_multiple)

    def _uniform_plan(self, mode: ForwardMode, num_tokens: int, per_seq: int) -> SplitPlan | None:
        """`plan` for a decode-like step whose requests all bring ``per_seq`` tokens, without a Python loop over its
        requests: an engine decides every step, and a 10,000-request decode step must cost what a 10-request one
        does. The same plan as the general path (`tests/test_split.py` compares them)."""
        if num_tokens < 0 or per_seq < 1 or num_tokens % per_seq:
            sequence_lens(mode, num_tokens, None, per_seq)  # raises, naming what is wrong
        if num_tokens < self.decode_token_threshold:
            return None
        n, parts = num_tokens // per_seq, self.num_microbatches
        if n < parts:
            return None
        seqs = [n // 2] if parts == 2 else [k * n // parts for k in range(1, parts)]
        bounds = [0, *seqs, n]
        slices = tuple(
            MicrobatchSlice(microbatch_idx=k, num_microbatches=parts, tokens_start=start * per_seq,
                            tokens_len=_round_up((end - start) * per_seq, self.pad_to_multiple),
                            tokens_unpadded_len=(end - start) * per_seq, requests_start=start,
                            requests_len=end - start, extend_lens=(per_seq,) * (end - start), prefix_offset=0)
            for k, (start, end) in enumerate(zip(bounds, bounds[1:])))
        return SplitPlan(mode=mode, num_tokens=num_tokens, num_requests=n, microbatches=slices,
                         cuts=tuple(Cut(seq * per_seq, seq, False) for seq in seqs))

    def _cuts(self, mode: ForwardMode, lens: list[int], token_num_per_seq: int) -> list[Cut] | None:
        n, total, parts = len(lens), sum(lens), self.num_microbatches
        if mode.is_decode_like and len(set(lens)) > 1:  # a verify step whose requests bring different draft counts
            return verify_cuts(lens, parts)
        if mode.is_decode_like and lens:
            token_num_per_seq = lens[0]  # uniform: 1 + k each, given as extend_lens
        if not self.allow_cut_sequences and not mode.is_decode_like:
            return boundary_cuts(lens, parts, self.token_distribution_threshold)
        if parts == 2:
            cut = (_decode_cut(n, token_num_per_seq) if mode.is_decode_like
                   else extend_cut(lens, self.token_distribution_threshold))
            return None if cut is None else [cut]
        if mode.is_decode_like:  # whole sequences only: a verified draft cannot be cut
            if n < parts:
                return None
            return [Cut(k * n // parts * token_num_per_seq, k * n // parts, False) for k in range(1, parts)]
        if total < parts:
            return None
        starts = [0, *accumulate(lens)]
        return [_cut_at_token(starts, k * total // parts) for k in range(1, parts)]
