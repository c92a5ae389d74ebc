"""The reference decoder: DeepSeek-V3-style (dense first layers, shared experts) or Qwen3-MoE-style, in plain torch.

Each layer exposes the ``op_*`` methods the built-in strategies name, and a plain `forward` that does not use ops;
both call the same math helpers, so the op path equals `forward` bit for bit. Ops pass everything through the
microbatch's State (keys listed in `STATE_FLOW`), so any op order that respects the data flow works; the only
keyword input is ``hidden_states`` to ``comm_prepare_attn``, which ``comm_postprocess_layer`` returns.

Per-step metadata is pinned in the State by the caller: ``attn`` and ``cache``, either `AttentionMetadata` with a
growing `KVCache` (the reference) or `StaticAttentionMetadata` with a preallocated `StaticKVCache` (fixed shapes,
no host reads: what a CUDA graph captures; `ReferenceModel.graph_runner` builds one for decode).

Devices: weights are generated from seeded CPU generators and then moved (``device=``), so every device holds the
same weights; every tensor an op creates is made on its input's device. Attention has three paths: per sequence,
per query (batch-invariant, the reference), all sequences in one padded call (the fast mode over a `KVCache`), and
over a fixed ``max_len`` with a length mask (a `StaticKVCache`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from tbo import strategies
from tbo.comm.alltoall import LocalBackend
from tbo.experts import StackedSwiGLU, run_experts
from tbo.runtime.forward import model_forward_maybe_tbo
from tbo.split.plan import MicrobatchSlice, SplitPlan
from tbo.core.dataflow import declares
from tbo.core.state import State
from tbo.core.strategy import OperationsStrategy
from tbo.models.cache import AttentionMetadata, KVCache, StaticAttentionMetadata, StaticKVCache
from tbo.models.config import ModelConfig
from tbo.models.functional import attend, attend_padded, attend_static, linear, pointwise, rms_norm, rope, swiglu
from tbo.models.layer_ops import DecoderLayerOps
from tbo.models.tensor_parallel import shard_layer, tp_reduced

if TYPE_CHECKING:
    from tbo.runtime.cuda_graph import GraphRunner

Metadata = AttentionMetadata | StaticAttentionMetadata
Cache = KVCache | StaticKVCache

__all__ = ["DecoderLayer", "ReferenceModel", "STATE_FLOW"]

#: Which op writes which State key, and which op consumes it: the data flow any strategy must respect, at a glance.
#: What binding checks is each op's own declaration (`tbo.core.dataflow.declares`; `tbo ops` prints them).
STATE_FLOW = {
    "residual": ("comm_prepare_attn / comm_prepare_mlp", "comm_prepare_mlp / output"),
    "attn_in": ("comm_prepare_attn", "attn_prepare"),
    "qkv": ("attn_prepare", "attn_core"),
    "attn_out": ("attn_core", "comm_prepare_mlp"),
    "mlp_in": ("comm_prepare_mlp", "mlp / dispatch_a / shared_experts"),
    "router_logits": ("gate", "select_experts"),
    "topk": ("select_experts", "dispatch_a"),
    "dispatch": ("dispatch_a", "dispatch_b"),
    "dispatched": ("dispatch_b", "experts"),
    "expert_out": ("experts", "combine_a"),
    "combine": ("combine_a", "combine_b"),
    "routed_out": ("combine_b", "output"),
    "shared_out": ("shared_experts", "output"),
    "mlp_out": ("mlp", "output"),
    "layer_out": ("output", "comm_postprocess_layer"),
}


def _init(g: torch.Generator, *shape: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


#: The weight attributes of a layer (a tensor or a tuple of tensors each), what `to` moves.
_WEIGHTS = ("input_norm", "post_attn_norm", "wq", "wk", "wv", "wo", "mlp_w", "w_router", "experts_w", "shared_w")


def _moved(value: Any, device: torch.device | str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(v.to(device) for v in value)
    return value


class DecoderLayer(DecoderLayerOps):
    """One decoder layer. ``kind`` is ``"dense"`` (SwiGLU MLP) or ``"moe"`` (router, shared and routed experts).

    ``reducer``: a `tbo.comm.TPAllReduce` over the tensor-parallel group; over more than one rank the layer keeps
    its rank's slice and sums its row-parallel outputs over the group (`tbo.models.tensor_parallel`)."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: Any,
                 device: torch.device | str | None = None, reducer: Any = None) -> None:
        c, dt = config, config.torch_dtype
        self.config, self.layer_idx, self.backend = c, layer_idx, backend
        self.kind = "dense" if layer_idx < c.first_k_dense else "moe"
        self.bi = c.batch_invariant
        g = torch.Generator().manual_seed(c.seed * 1000 + layer_idx + 1)
        h, qd = c.hidden_size, c.num_heads * c.head_dim
        self.input_norm = 1 + _init(g, h, scale=0.1, dtype=dt)
        self.post_attn_norm = 1 + _init(g, h, scale=0.1, dtype=dt)
        self.wq, self.wk, self.wv = (_init(g, h, qd, scale=h**-0.5, dtype=dt) for _ in range(3))
        self.wo = _init(g, qd, h, scale=qd**-0.5, dtype=dt)
        if self.kind == "dense":
            i = c.dense_intermediate
            self.mlp_w = (_init(g, h, i, scale=h**-0.5, dtype=dt), _init(g, h, i, scale=h**-0.5, dtype=dt),
                          _init(g, i, h, scale=i**-0.5, dtype=dt))
            shard_layer(self, reducer)
            self.to(device)
            return
        e, i = c.num_experts, c.moe_intermediate
        self.w_router = _init(g, h, e, scale=h**-0.5, dtype=dt)
        self.experts_w = (_init(g, e, h, i, scale=h**-0.5, dtype=dt), _init(g, e, h, i, scale=h**-0.5, dtype=dt),
                          _init(g, e, i, h, scale=i**-0.5, dtype=dt))
        si = i * c.num_shared_experts
        self.shared_w = (_init(g, h, si, scale=h**-0.5, dtype=dt), _init(g, h, si, scale=h**-0.5, dtype=dt),
                         _init(g, si, h, scale=si**-0.5, dtype=dt)) if si else None
        if e % backend.num_ranks:
            raise ValueError(f"num_experts={e} is not divisible by the backend's {backend.num_ranks} ranks")
        self._expert_base = backend.rank * backend.num_local_experts
        shard_layer(self, reducer)
        self.to(device)

    def to(self, device: torch.device | str | None) -> "DecoderLayer":
        """Move the weights to ``device`` (None: leave them); returns the layer."""
        if device is not None:
            for name in _WEIGHTS:
                if hasattr(self, name):
                    setattr(self, name, _moved(getattr(self, name), device))
        return self

    @property
    def device(self) -> torch.device:
        return self.wq.device

    def local_expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` (global ``rank * num_local_experts + e``) on its rows."""
        wg, wu, wd = self.experts_w
        g = self._expert_base + e
        return swiglu(rows, wg[g], wu[g], wd[g], self.bi)

    @property
    def stacked_experts(self) -> StackedSwiGLU | None:  # type: ignore[override]
        """The local experts' weights, stacked (views): what lets a GPU run them in one GEMM chain or a grouped
        GEMM. None in batch-invariant mode, where a row's result must not depend on the GEMM's shape."""
        if self.kind != "moe" or self.bi:
            return None
        lo, hi = self._expert_base, self._expert_base + self.backend.num_local_experts
        wg, wu, wd = self.experts_w
        return StackedSwiGLU(wg[lo:hi], wu[lo:hi], wd[lo:hi])

    def __repr__(self) -> str:
        return f"DecoderLayer({self.layer_idx}, {self.kind})"

    # ---- math shared by forward() and the ops -------------------------------------------------------------------
    def _qkv(self, x: torch.Tensor, meta: Metadata) -> tuple[torch.Tensor, ...]:
        c, t = self.config, x.shape[0]
        pos = meta.positions(x.device)
        if pos.shape[0] < t:  # padding rows: any position; their outputs are discarded
            pos = torch.cat([pos, pos.new_zeros(t - pos.shape[0])])
        shape = (t, self.num_local_heads, c.head_dim)
        q = rope(linear(x, self.wq, self.bi).view(shape), pos, c.rope_theta, self.bi)
        k = rope(linear(x, self.wk, self.bi).view(shape), pos, c.rope_theta, self.bi)
        return q, k, linear(x, self.wv, self.bi).view(shape)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Metadata,
                   cache: Cache) -> torch.Tensor:
        if isinstance(cache, StaticKVCache):
            if not isinstance(meta, StaticAttentionMetadata):
                raise TypeError(f"a StaticKVCache needs StaticAttentionMetadata, got {type(meta).__name__}")
            out = self._attention_static(q, k, v, meta, cache)
        elif isinstance(meta, StaticAttentionMetadata):
            raise TypeError("StaticAttentionMetadata needs a StaticKVCache, got a growing KVCache")
        elif self.bi or not self._padded_attention(q.device):
            out = self._attention_reference(q, k, v, meta, cache)
        else:
            out = self._attention_batched(q, k, v, meta, cache)
        return linear(out.flatten(1), self.wo, self.bi)

    def _padded_attention(self, device: torch.device) -> bool:
        """Fast mode over a growing cache: one padded call (``"padded"``, or ``"auto"`` off the CPU) or a loop."""
        mode = self.config.fast_attention
        return mode == "padded" or (mode == "auto" and device.type != "cpu")

    def _attention_reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                             cache: KVCache) -> torch.Tensor:
        """Sequence by sequence: the batch-invariant reference (query by query), or the fast mode's loop."""
        out = torch.zeros_like(q)
        start = 0
        for seq, n, prefix in zip(meta.seq_ids, meta.extend_lens, meta.prefix_lens):
            if n:
                ks, vs = cache.append(self.layer_idx, seq, k[start : start + n], v[start : start + n], prefix)
                out[start : start + n] = attend(q[start : start + n], ks, vs, prefix, self.bi)
            start += n
        return out

    def _attention_batched(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                           cache: KVCache) -> torch.Tensor:
        """The fast mode: the cache appends per sequence, then one padded attention call for every sequence."""
        keys, values, lens, prefixes = [], [], [], []
        start = 0
        for seq, n, prefix in zip(meta.seq_ids, meta.extend_lens, meta.prefix_lens):
            if n:
                ks, vs = cache.append(self.layer_idx, seq, k[start : start + n], v[start : start + n], prefix)
                keys.append(ks)
                values.append(vs)
                lens.append(n)
                prefixes.append(prefix)
            start += n
        out = torch.zeros_like(q)
        if keys:  # the real tokens are the first ``start`` rows, sequence after sequence; the rest is padding
            out[:start] = attend_padded(q[:start], keys, values, lens, prefixes)
        return out

    def _attention_static(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StaticAttentionMetadata,
                          cache: StaticKVCache) -> torch.Tensor:
        """Write this step's keys in place, attend over each sequence's slot with a length mask: fixed shapes."""
        t = meta.num_tokens
        if q.shape[0] != t:
            raise ValueError(f"layer {self.layer_idx}: {q.shape[0]} tokens but the metadata describes {t}")
        cache.write(self.layer_idx, meta.slots, meta.position_ids, k, v)
        k_seq, v_seq = cache.read(self.layer_idx, meta.seq_slots, meta.slot_offset)  # [S, max_len, h, d]
        if meta.max_query == 1 and meta.is_decode:  # decode: sequence t is token t
            q_seq, pos = q.unsqueeze(1), meta.position_ids.unsqueeze(1)
            return attend_static(q_seq, k_seq, v_seq, pos, self.bi).squeeze(1)
        s = meta.seq_slots.shape[0]
        q_seq = q.new_zeros((s, meta.max_query, *q.shape[1:])).index_put_((meta.token_seq, meta.token_row), q)
        pos = torch.zeros((s, meta.max_query), dtype=torch.long, device=q.device).index_put_(
            (meta.token_seq, meta.token_row), meta.position_ids)
        return attend_static(q_seq, k_seq, v_seq, pos, self.bi)[meta.token_seq, meta.token_row]

    def _select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        scores = logits.float().softmax(-1) if c.scoring == "softmax" else pointwise(torch.sigmoid, logits.float(),
                                                                                      self.bi)
        weights, idx = torch.topk(scores, c.top_k, dim=-1)
        if c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return idx, weights * c.routed_scaling_factor

    # ---- the hooks DecoderLayerOps needs ----------------------------------------------------------------------
    def attn_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.input_norm, self.config.rms_eps)

    def mlp_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.post_attn_norm, self.config.rms_eps)

    @property
    def has_shared_experts(self) -> bool:
        return getattr(self, "shared_w", None) is not None

    def shared_experts(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, *self.shared_w, self.bi)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's FFN on its normed input: the dense MLP, or router + routed experts (+ shared experts).

        What an attention-FFN disaggregated deployment runs on the FFN side.
        """
        if self.kind == "dense":
            return tp_reduced(self, swiglu(x, *self.mlp_w, self.bi), "mlp_reduce")
        idx, weights = self._select(linear(x, self.w_router, self.bi))
        dispatched = self.backend.dispatch_b(self.backend.dispatch_a(x, idx, weights))
        out = run_experts(dispatched, self.local_expert, self.stacked_experts)
        routed = tp_reduced(self, self.backend.combine_b(self.backend.combine_a(out, dispatched.handle)),
                            "moe_reduce")
        if not self.has_shared_experts:
            return routed
        return routed + tp_reduced(self, self.shared_experts(x), "shared_reduce")

    def forward(self, hidden: torch.Tensor, meta: Metadata, cache: Cache) -> torch.Tensor:
        """The layer without ops: the reference the op path and every strategy must equal."""
        attn = tp_reduced(self, self._attention(*self._qkv(self.attn_norm(hidden), meta), meta, cache), "attn_reduce")
        residual = hidden + attn
        return residual + self.ffn(self.mlp_norm(residual))

    # ---- the ops that touch this layer's own modules (the rest come from DecoderLayerOps) ----------------------
    @declares(takes="attn_in", writes="qkv", pinned="attn")
    def op_attn_prepare(self, state: State) -> None:
        state.qkv = self._qkv(state.pop("attn_in"), state.attn)

    @declares(takes="qkv", writes="attn_out", pinned=("attn", "cache"))
    def op_attn_core(self, state: State) -> None:
        state.attn_out = self._attention(*state.pop("qkv"), state.attn, state.cache)

    @declares(takes="mlp_in", writes="mlp_out")
    def op_mlp(self, state: State) -> None:
        state.mlp_out = swiglu(state.pop("mlp_in"), *self.mlp_w, self.bi)

    @declares(reads="mlp_in", writes="router_logits")
    def op_gate(self, state: State) -> None:
        state.router_logits = linear(state.mlp_in, self.w_router, self.bi)

    @declares(takes="router_logits", writes="topk")
    def op_select_experts(self, state: State) -> None:
        state.topk = self._select(state.pop("router_logits"))


class ReferenceModel:
    """Embedding, decoder layers and LM head, with seeded weights; experts run through an `EPBackend`.

    ``device``: where the weights live (None: the CPU). They are generated from the seeded CPU generators first and
    then moved, so a CPU and a GPU build hold the same weights. `to` moves a built model.
    """

    def __init__(self, config: ModelConfig, backend: Any = None, device: torch.device | str | None = None,
                 reducer: Any = None) -> None:
        self.config = config
        self.reducer = reducer
        self.backend = backend if backend is not None else LocalBackend(config.num_experts)
        g = torch.Generator().manual_seed(config.seed)
        dt = config.torch_dtype
        self.embedding = _init(g, config.vocab_size, config.hidden_size, scale=1.0, dtype=dt)
        self.final_norm = 1 + _init(g, config.hidden_size, scale=0.1, dtype=dt)
        self.lm_head = _init(g, config.hidden_size, config.vocab_size, scale=config.hidden_size**-0.5, dtype=dt)
        self.layers = [DecoderLayer(config, i, self.backend, reducer=reducer) for i in range(config.num_layers)]
        self._bound: dict[Any, OperationsStrategy] = {}
        self.to(device)

    def to(self, device: torch.device | str | None) -> "ReferenceModel":
        """Move every weight to ``device`` (None: leave them); returns the model."""
        if device is not None:
            self.embedding, self.final_norm, self.lm_head = (t.to(device) for t in (self.embedding, self.final_norm,
                                                                                     self.lm_head))
            for layer in self.layers:
                layer.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    def use_backend(self, backend: Any) -> Any:
        """Route every MoE layer's experts through ``backend`` from now on (e.g. a `traced` wrapper for one traced
        step) without rebuilding the weights; returns the previous backend. Its topology must match."""
        old = self.backend
        for name in ("num_experts", "num_ranks", "rank", "num_local_experts"):
            if getattr(backend, name) != getattr(old, name):
                raise ValueError(f"use_backend: the new backend's {name}={getattr(backend, name)} differs from "
                                 f"{getattr(old, name)}")
        self.backend = backend
        for layer in self.layers:
            layer.backend = backend
        return old

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding[input_ids.to(self.embedding.device)]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(hidden, self.final_norm, self.config.rms_eps), self.lm_head,
                      self.config.batch_invariant)

    def bind(self, strategy: Any) -> OperationsStrategy:
        """The whole stack's bound strategy (a name, a strategy, or per-kind strategies); cached per strategy."""
        if isinstance(strategy, str):
            strategy = strategies.get(strategy)
        try:
            return self._bound[strategy]
        except (KeyError, TypeError):  # TypeError: an unhashable mapping or function, bound every time
            bound = strategies.bind_layers(self.layers, strategy)
            try:
                self._bound[strategy] = bound
            except TypeError:
                pass
            return bound

    def auto_strategy(self, meta: Metadata) -> str:
        """``strategy="auto"``: the registered strategy this model's layers call for (`tbo.strategies.auto_names`),
        decode's for a step of one token per sequence, else prefill's."""
        names = strategies.auto_names_for_layers(self.layers)
        decode = meta.is_decode if isinstance(meta, StaticAttentionMetadata) else set(meta.extend_lens) <= {1}
        return names.decode if decode else names.prefill

    def forward_tbo(self, input_ids: torch.Tensor, meta: Metadata, cache: Cache, strategy: Any,
                    plan: SplitPlan | None, rows_per_rank: Sequence[Sequence[int]] | None = None,
                    **kwargs: Any) -> torch.Tensor:
        """Logits of every token through the ops: overlapped over ``plan``, or as one batch when it is None.
        ``strategy``: a strategy, a registered name, per-kind strategies, or ``"auto"`` (`auto_strategy`).

        ``rows_per_rank[m]``: data parallel, the token rows every rank dispatches in microbatch ``m`` (one entry
        unsplit), agreed by all of them (`tbo.split.agree`): the dispatch then sends by them, with no count
        exchange."""
        if input_ids.shape[0] != meta.num_tokens:
            raise ValueError(f"input_ids has {input_ids.shape[0]} tokens but the metadata describes {meta.num_tokens}")
        if plan is not None and plan.num_tokens != meta.num_tokens:
            raise ValueError(f"the plan covers {plan.num_tokens} tokens but the batch has {meta.num_tokens}")
        if isinstance(strategy, str) and strategy == "auto":
            strategy = self.auto_strategy(meta)

        def pinned(mb: MicrobatchSlice | None) -> dict[str, Any]:
            values = {"attn": meta if mb is None else meta.for_microbatch(mb), "cache": cache}
            if rows_per_rank is not None:
                values["rows_per_rank"] = tuple(rows_per_rank[0 if mb is None else mb.microbatch_idx])
            return values

        out = model_forward_maybe_tbo(self.layers, {"hidden_states": self.embed(input_ids)}, self.bind(strategy),
                                      plan, pinned=pinned, backend=self.backend, **kwargs)
        return self.head(out["hidden_states"])

    def forward(self, input_ids: torch.Tensor, meta: Metadata, cache: Cache) -> torch.Tensor:
        """Logits of every token, layer by layer, without ops or overlap."""
        if input_ids.shape[0] != meta.num_tokens:
            raise ValueError(f"input_ids has {input_ids.shape[0]} tokens but the metadata describes {meta.num_tokens}")
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer.forward(hidden, meta, cache)
        return self.head(hidden)

    # ---- static cache and CUDA graphs ---------------------------------------------------------------------------
    def static_cache(self, num_slots: int, max_len: int) -> StaticKVCache:
        """A `StaticKVCache` for this model on its device: ``num_slots`` sequences of up to ``max_len`` tokens."""
        heads = self.layers[0].num_local_heads  # this rank's heads under tensor parallelism
        return StaticKVCache.for_model(self.config.model_copy(update={"num_heads": heads}), num_slots, max_len,
                                       self.device)

    def decode_step(self, cache: StaticKVCache, strategy: Any, slots_in_order: bool = False) -> Any:
        """A decode step as `tbo.runtime.cuda_graph.GraphRunner` calls it: ``step(inputs, plan) -> logits``, where
        ``inputs`` holds ``ids``, ``positions`` and ``slots`` (one token per sequence, device tensors).

        ``slots_in_order``: request ``t`` always sits in slot ``t`` (padding requests excepted), so attention reads
        the cache by a view rather than gathering each request's whole context first (see `StaticKVCache.read`).
        """
        self.bind(strategy)  # bound once, now: a bad strategy fails here, not inside a capture
        offset = 0 if slots_in_order else None

        def step(inputs: Any, plan: SplitPlan | None) -> torch.Tensor:
            meta = StaticAttentionMetadata.decode(inputs["positions"], inputs["slots"], cache.scratch_slot, offset)
            return self.forward_tbo(inputs["ids"], meta, cache, strategy, plan)

        return step

    def graph_runner(self, cache: StaticKVCache, strategy: Any, batch_sizes: Sequence[int],
                     slots_in_order: bool = False, **kwargs: Any) -> "GraphRunner":
        """A `GraphRunner` over `decode_step`: padding requests write to the cache's scratch slot at position 0.

        Capture needs a capture-safe backend: `LocalBackend` MASKED with a fixed ``masked_capacity`` of at least the
        largest bucket (checked here), or a `CopyEngineLink` over one. Above the largest bucket the runner goes
        eager, and the backend sizes that step for its own tokens. ``slots_in_order``: see `decode_step`.
        ``kwargs`` go to `GraphRunner` (``policy``, ``capture``, ``capturer``, ...).
        """
        from tbo.runtime.cuda_graph import GraphRunner

        capacity = getattr(self.backend, "masked_capacity", None)  # through any BackendWrapper
        if kwargs.get("capture", True) and capacity is not None and max(batch_sizes) > capacity:
            raise ValueError(f"graph_runner: the largest bucket ({max(batch_sizes)} requests) exceeds the backend's "
                             f"masked_capacity={capacity}; a captured step may carry at most masked_capacity tokens")
        pad = {"ids": 0, "positions": 0, "slots": cache.scratch_slot, **kwargs.pop("pad_values", {})}
        return GraphRunner(self.decode_step(cache, strategy, slots_in_order), batch_sizes, pad_values=pad, **kwargs)
