"""KV caches and the attention metadata of a (micro)batch.

Decode steps really read the cache: each layer appends a sequence's new keys and values and attends over everything
cached for it. With a two-chunk split, the second chunk's attention runs after the first chunk's (the first
microbatch leads), so it finds the first chunk's keys already cached: its ``prefix_len`` covers them.

Two caches: `KVCache` grows per sequence (host metadata, `AttentionMetadata`: the reference), and `StaticKVCache`
is one preallocated ``[layers, slots, max_len, heads, dim]`` buffer written in place, read over a fixed ``max_len``
with a length mask, driven by `StaticAttentionMetadata` (positions and slots as device tensors). Graph replay needs
the latter: fixed addresses, fixed shapes, no host reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from tbo.split.plan import MicrobatchSlice

__all__ = ["KVCache", "AttentionMetadata", "StaticKVCache", "StaticAttentionMetadata"]


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

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Each token's absolute position, on ``device`` (built on the host, copied once)."""
        pos = [p + i for p, n in zip(self.prefix_lens, self.extend_lens) for i in range(n)]
        return torch.tensor(pos, dtype=torch.long, device=device)

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


class StaticKVCache:
    """Keys and values of ``num_slots`` sequences, ``max_len`` positions each, for every layer, preallocated.

    A step writes each token's keys and values in place at ``[layer, slot, position]`` and attends over the slot's
    whole ``max_len`` with a length mask: addresses and shapes never change, so a captured graph can replay the
    step. Slot ``num_slots`` is a scratch slot for padding rows (what `scratch_slot` names): writes there are
    harmless. Which positions hold a sequence's tokens is the caller's business (the position of each new token).
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        if min(num_layers, num_slots, max_len, num_heads, head_dim) < 1:
            raise ValueError(f"StaticKVCache sizes must be positive, got layers={num_layers}, slots={num_slots}, "
                             f"max_len={max_len}, heads={num_heads}, head_dim={head_dim}")
        shape = (num_layers, num_slots + 1, max_len, num_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_len = num_slots, max_len

    @classmethod
    def for_model(cls, config: "object", num_slots: int, max_len: int,
                  device: torch.device | str | None = None) -> "StaticKVCache":
        """Sized for a `ModelConfig` (its layers, heads, head dim and dtype)."""
        c: Any = config
        return cls(c.num_layers, num_slots, max_len, c.num_heads, c.head_dim, c.torch_dtype, device)

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def device(self) -> torch.device:
        return self.k.device

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Keys and values of tokens ``[T, heads, dim]`` at ``(slots[t], positions[t])``, in place."""
        self.k[layer].index_put_((slots, positions), k)
        self.v[layer].index_put_((slots, positions), v)

    def read(self, layer: int, slots: torch.Tensor, first: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole ``[S, max_len, heads, dim]`` of each of ``slots``.

        ``first``: the caller knows that the slots are ``first, first + 1, ...`` (a run of slots in order): then the
        result is a view of the cache, not a copy. A gather copies each slot's whole ``max_len`` before attention
        reads it again, three passes over the context instead of one. Padding rows past the run may read the slots
        after it (or copies are made when the run would leave the cache): their outputs are discarded.
        """
        s = slots.shape[0]
        if first is not None and 0 <= first and first + s <= self.k.shape[1]:
            return self.k[layer, first : first + s], self.v[layer, first : first + s]
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)

    def load(self, cache: KVCache, seq_slots: Sequence[int]) -> "StaticKVCache":
        """Copy a growing cache's sequences (sequence ``i`` into slot ``seq_slots[i]``): what decode continues from."""
        for (layer, seq), k in cache._k.items():
            n = k.shape[0]
            if n > self.max_len:
                raise ValueError(f"sequence {seq} holds {n} tokens, more than max_len={self.max_len}")
            self.k[layer, seq_slots[seq], :n] = k.to(self.k)
            self.v[layer, seq_slots[seq], :n] = cache._v[(layer, seq)].to(self.v)
        return self

    def clone(self) -> "StaticKVCache":
        other = object.__new__(StaticKVCache)
        other.k, other.v = self.k.clone(), self.v.clone()
        other.num_slots, other.max_len = self.num_slots, self.max_len
        return other


@dataclass(frozen=True)
class StaticAttentionMetadata:
    """A step's attention metadata as device tensors, for a `StaticKVCache`.

    Per token: its position and its cache slot. Per sequence: its slot (``seq_slots``), and each token's sequence
    and row within it (``token_seq``, ``token_row``; ``max_query`` rows at most): attention runs per sequence over
    its slot. Decode (`decode`) is the identity view, one token per sequence, built on the device with no host
    information at all: what a captured decode step takes as input. `build` makes the general (prefill) view from
    host lists. Padding rows use the scratch slot at position 0.

    ``slot_offset``: sequence ``s`` sits in slot ``slot_offset + s`` (its padding rows excepted), so attention reads
    the cache by a view instead of gathering a copy (`StaticKVCache.read`). `build` finds it in its host lists;
    for `decode` the caller promises it (checked on the CPU, where reading is free).
    """

    position_ids: torch.Tensor  #: [T]
    slots: torch.Tensor  #: [T]
    seq_slots: torch.Tensor  #: [S]
    token_seq: torch.Tensor  #: [T]
    token_row: torch.Tensor  #: [T]
    max_query: int
    scratch_slot: int
    host: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None  #: (slots, extend, prefix) lists
    slot_offset: int | None = None  #: sequence s sits in slot slot_offset + s: read the cache by a view
    #: per-microbatch views already made: a captured prefill step must not build tensors from host lists
    _views: dict[MicrobatchSlice, "StaticAttentionMetadata"] = field(default_factory=dict, compare=False,
                                                                     repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.position_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.host is None

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        return self.position_ids if device is None else self.position_ids.to(device)

    @classmethod
    def decode(cls, positions: torch.Tensor, slots: torch.Tensor, scratch_slot: int,
               slot_offset: int | None = None) -> "StaticAttentionMetadata":
        """One token per sequence: token ``t`` of sequence slot ``slots[t]`` at ``positions[t]``.

        ``slot_offset``: the caller's promise that ``slots[t] == slot_offset + t`` for every real token (padding rows
        may name the scratch slot): attention then reads the cache by a view. Checked here on the CPU; on a GPU
        checking would read the device, so a broken promise attends over the wrong slots.
        """
        if positions.shape != slots.shape or positions.dim() != 1:
            raise ValueError(f"positions {tuple(positions.shape)} and slots {tuple(slots.shape)} must be the same "
                             "1-D shape (one entry per token)")
        t = positions.shape[0]
        rows = torch.arange(t, device=positions.device)
        if slot_offset is not None and slots.device.type == "cpu":
            ok = (slots == rows + slot_offset) | (slots == scratch_slot)
            if not bool(ok.all()):
                bad = int((~ok).nonzero()[0, 0])
                raise ValueError(f"decode: slot_offset={slot_offset} promises token {bad} sits in slot "
                                 f"{slot_offset + bad}, but slots[{bad}] = {int(slots[bad])}")
        return cls(positions, slots, slots, rows, torch.zeros_like(rows), 1, scratch_slot, slot_offset=slot_offset)

    @classmethod
    def build(cls, seq_slots: Sequence[int], extend_lens: Sequence[int], prefix_lens: Sequence[int],
              scratch_slot: int, device: torch.device | str | None = None) -> "StaticAttentionMetadata":
        """Sequences with ``extend_lens`` new tokens after ``prefix_lens`` cached ones (prefill, mixed steps)."""
        if not len(seq_slots) == len(extend_lens) == len(prefix_lens):
            raise ValueError("seq_slots, extend_lens and prefix_lens must have one entry per sequence")
        keep = [i for i, n in enumerate(extend_lens) if n]  # a sequence with no new token attends nothing
        pos = [prefix_lens[i] + r for i in keep for r in range(extend_lens[i])]
        slot = [seq_slots[i] for i in keep for _ in range(extend_lens[i])]
        seq = [j for j, i in enumerate(keep) for _ in range(extend_lens[i])]
        row = [r for i in keep for r in range(extend_lens[i])]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        kept = [int(seq_slots[i]) for i in keep]
        in_order = bool(kept) and kept == list(range(kept[0], kept[0] + len(kept)))
        return cls(tensor(pos), tensor(slot), tensor(kept), tensor(seq), tensor(row),
                   max((extend_lens[i] for i in keep), default=1), scratch_slot,
                   (tuple(seq_slots), tuple(extend_lens), tuple(prefix_lens)), kept[0] if in_order else None)

    def for_microbatch(self, mb: MicrobatchSlice) -> "StaticAttentionMetadata":
        """This microbatch's share, padded to its padded token count with scratch-slot rows.

        Made once per microbatch and kept: a general (host-built) view copies host lists to the device, which a
        CUDA graph cannot capture, so the warm-up run before a capture makes it and the capture reuses it.
        """
        if mb not in self._views:
            self._views[mb] = self._for_microbatch(mb)
        return self._views[mb]

    def _for_microbatch(self, mb: MicrobatchSlice) -> "StaticAttentionMetadata":
        if self.host is not None:
            slots, _, prefix = self.host
            lo, hi = mb.requests_start, mb.requests_end
            prefix_mb = list(prefix[lo:hi])
            if prefix_mb:
                prefix_mb[0] += mb.prefix_offset
            meta = StaticAttentionMetadata.build(slots[lo:hi], mb.extend_lens, prefix_mb, self.scratch_slot,
                                                 self.position_ids.device)
        else:
            sl = slice(mb.tokens_start, mb.tokens_end)
            offset = None if self.slot_offset is None else self.slot_offset + mb.tokens_start
            meta = StaticAttentionMetadata.decode(self.position_ids[sl], self.slots[sl], self.scratch_slot, offset)
        return meta.padded(mb.tokens_len)

    def padded(self, num_tokens: int) -> "StaticAttentionMetadata":
        """Padding rows to ``num_tokens``: each its own one-token sequence in the scratch slot at position 0."""
        missing = num_tokens - self.num_tokens
        if missing <= 0:
            return self
        dev = self.position_ids.device
        zeros = torch.zeros(missing, dtype=torch.long, device=dev)
        scratch = torch.full((missing,), self.scratch_slot, dtype=torch.long, device=dev)
        s = self.seq_slots.shape[0]
        return StaticAttentionMetadata(
            torch.cat([self.position_ids, zeros]), torch.cat([self.slots, scratch]),
            torch.cat([self.seq_slots, scratch]), torch.cat([self.token_seq, torch.arange(s, s + missing, device=dev)]),
            torch.cat([self.token_row, zeros]), self.max_query, self.scratch_slot, self.host, self.slot_offset)
