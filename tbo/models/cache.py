"""The per-sequence KV cache and the attention metadata of a (micro)batch.

Decode steps really read the cache: each layer appends a sequence's new keys and values and attends over everything
cached for it. With a two-chunk split, the second chunk's attention runs after the first chunk's (the first
microbatch leads), so it finds the first chunk's keys already cached: its ``prefix_len`` covers them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tbo.split.plan import MicrobatchSlice

__all__ = ["KVCache", "AttentionMetadata"]


class KVCache:
    """Keys and values per (layer, sequence), appended step by step."""

    def __init__(self) -> None:
        self._k: dict[tuple[int, int], torch.Tensor] = {}
        self._v: dict[tuple[int, int], torch.Tensor] = {}

    def length(self, layer: int, seq_id: int) -> int:
        k = self._k.get((layer, seq_id))
        return 0 if k is None else k.shape[0]

    def append(self, layer: int, seq_id: int, k: torch.Tensor, v: torch.Tensor, prefix_len: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's keys/values after exactly ``prefix_len`` cached ones; return the sequence's whole cache."""
        have = self.length(layer, seq_id)
        if have != prefix_len:
            raise ValueError(f"layer {layer}, sequence {seq_id}: the cache holds {have} tokens but this step "
                             f"expects a prefix of {prefix_len}")
        key = (layer, seq_id)
        self._k[key] = k if have == 0 else torch.cat([self._k[key], k])
        self._v[key] = v if have == 0 else torch.cat([self._v[key], v])
        return self._k[key], self._v[key]

    def clone(self) -> "KVCache":
        other = KVCache()
        other._k, other._v = dict(self._k), dict(self._v)
        return other

    def __len__(self) -> int:
        return len(self._k)


@dataclass(frozen=True)
class AttentionMetadata:
    """Which sequences a batch's tokens belong to, how many each adds, and how many each already has cached."""

    seq_ids: tuple[int, ...]
    extend_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.seq_ids) == len(self.extend_lens) == len(self.prefix_lens):
            raise ValueError("seq_ids, extend_lens and prefix_lens must have one entry per sequence")

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(p, p + n) for p, n in zip(self.prefix_lens, self.extend_lens)]) if (
            self.seq_ids) else torch.zeros(0, dtype=torch.long)

    @classmethod
    def build(cls, seq_ids: Sequence[int], extend_lens: Sequence[int], prefix_lens: Sequence[int]
              ) -> "AttentionMetadata":
        return cls(tuple(int(s) for s in seq_ids), tuple(int(n) for n in extend_lens),
                   tuple(int(p) for p in prefix_lens))

    def for_microbatch(self, mb: MicrobatchSlice) -> "AttentionMetadata":
        """This microbatch's share: a cut sequence's second chunk has the first chunk in its prefix."""
        lo, hi = mb.requests_start, mb.requests_end
        prefix = list(self.prefix_lens[lo:hi])
        if prefix:
            prefix[0] += mb.prefix_offset
        return AttentionMetadata(self.seq_ids[lo:hi], mb.extend_lens, tuple(prefix))
