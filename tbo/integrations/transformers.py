"""Hugging Face MoE models through tbo: DeepseekV3 and Qwen3-MoE decoder layers as op lists, TBO forward, generate.

`TboDecoderLayer` wraps an HF decoder layer and exposes the ``op_*`` methods the built-in strategies name, using the
layer's own modules: the norms, ``self_attn``, ``mlp.gate``, ``mlp.shared_experts`` and the ``mlp.experts``
weights. The one thing done differently is expert dispatch, which goes through an `EPBackend` (so experts can live on
other ranks); the per-expert compute reproduces HF's experts module.

`forward` drives a whole ``...ForCausalLM`` the way HF's model forward does (its mask, positions and rotary
embeddings), splitting the batch by rows into two microbatches when the `SplitPolicy` says so: each microbatch gets
its rows of the attention mask, positions and KV cache, and the cache rows are joined back after the step.
`generate` is greedy decoding on top. ``transformers`` is imported only here (the ``hf`` extra).

Supported: transformers 5.17 up to the newest 5.x (CI runs the tests on 5.17 and on the newest). During 5.x the KV
cache's keyword was renamed from ``past_key_values`` to ``cache`` (in ``create_causal_mask``, the attention and model
forwards, and the model outputs); `cache_kwarg` and `output_cache` detect which one the installed version uses, by
signature, not by version number. An older transformers is refused with an ImportError naming the range.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import torch
import torch.nn.functional as F

from tbo import strategies
from tbo.util.optional import extra_hint, require
from tbo.comm.alltoall import LocalBackend
from tbo.models.layer_ops import DecoderLayerOps
from tbo.split import ForwardMode, Slot, SplitPolicy, agree_to_split
from tbo.core.dataflow import declares
from tbo.core.state import State
from tbo.runtime.forward import model_forward_maybe_tbo
from tbo.split.plan import MicrobatchSlice, SplitPlan

__all__ = ["TboDecoderLayer", "forward", "generate", "SUPPORTED_LAYERS", "SUPPORTED_ATTENTION",
           "SUPPORTED_TRANSFORMERS", "cache_kwarg", "output_cache", "check_transformers_version"]

#: decoder layer class -> strategy family
SUPPORTED_LAYERS = {"DeepseekV3DecoderLayer": "deepseek", "Qwen3MoeDecoderLayer": "qwen3_moe"}
#: attention implementations whose mask is a per-row tensor (or None) that can be cut by rows
SUPPORTED_ATTENTION = ("eager", "sdpa")


#: the transformers versions the adapter is tested on (the floor and the newest 5.x, in CI); pyproject's ``hf`` extra
SUPPORTED_TRANSFORMERS = ">=5.17,<6"
_FLOOR = (5, 17)


def check_transformers_version(version: str) -> None:
    """Refuse a transformers older than the supported range, naming it (a version that does not parse is let
    through: a source build is judged by what it has, through `cache_kwarg`)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is not None and (int(m[1]), int(m[2])) < _FLOOR:
        raise ImportError(f"tbo.integrations.transformers supports transformers {SUPPORTED_TRANSFORMERS} (tested on "
                          f"5.17 and the newest 5.x), but {version} is installed: {extra_hint('hf')}")


def _transformers() -> Any:
    hf = require("transformers", f"tbo.integrations.transformers ({extra_hint('hf')})")
    check_transformers_version(getattr(hf, "__version__", ""))
    return hf


@lru_cache(maxsize=64)
def _kv_name(fn: Callable) -> str:
    params = inspect.signature(fn).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{getattr(fn, '__qualname__', fn)} takes neither cache= nor past_key_values=: this transformers "
                    f"is outside the supported range {SUPPORTED_TRANSFORMERS}")


def cache_kwarg(fn: Any) -> str:
    """The keyword under which ``fn`` (a function, or a module: its ``forward``) takes the KV cache: ``cache`` in
    newer transformers 5.x, ``past_key_values`` in older ones."""
    fn = getattr(fn, "forward", fn)
    return _kv_name(getattr(fn, "__func__", fn))


def output_cache(output: Any) -> Any:
    """The KV cache of a model output: ``output.cache``, or ``output.past_key_values`` before the rename."""
    return output.cache if hasattr(output, "cache") else output.past_key_values


@dataclass
class _Step:
    """What one microbatch's attention needs for this step: its rows of mask, positions, rotary, cache."""

    attention_mask: Any
    position_ids: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    cache: Any


class TboDecoderLayer(DecoderLayerOps):
    """An HF ``DeepseekV3DecoderLayer`` / ``Qwen3MoeDecoderLayer`` as ops; experts dispatched through ``backend``."""

    def __init__(self, hf_layer: Any, backend: Any, layer_idx: int) -> None:
        cls = type(hf_layer).__name__
        if cls not in SUPPORTED_LAYERS:
            raise TypeError(f"unsupported decoder layer class {cls}; supported: {', '.join(SUPPORTED_LAYERS)}")
        impl = getattr(hf_layer.self_attn.config, "_attn_implementation", None)
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(f"unsupported attention implementation {impl!r} in {cls}; supported: "
                             f"{', '.join(SUPPORTED_ATTENTION)} (load the model with attn_implementation='sdpa')")
        self.hf, self.backend, self.layer_idx = hf_layer, backend, layer_idx
        self._cache_kw = cache_kwarg(hf_layer.self_attn)  # past_key_values= or cache=, as this transformers names it
        self.family = SUPPORTED_LAYERS[cls]
        mlp = hf_layer.mlp
        self.kind = "moe" if hasattr(mlp, "experts") else "dense"
        self.shared = getattr(mlp, "shared_experts", None) if self.kind == "moe" else None
        self.has_shared_experts = self.shared is not None
        if self.kind == "moe":
            experts = mlp.experts
            if experts.num_experts != backend.num_experts:
                raise ValueError(f"layer {layer_idx} has {experts.num_experts} experts but the backend routes "
                                 f"{backend.num_experts}")
            self._experts, self._expert_base = experts, backend.rank * backend.num_local_experts

    def __repr__(self) -> str:
        return f"TboDecoderLayer({self.layer_idx}, {type(self.hf).__name__}, {self.kind})"

    def local_expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """HF's experts module for one local expert: gate/up projection, activation, down projection."""
        g = self._expert_base + e
        gate, up = F.linear(rows, self._experts.gate_up_proj[g]).chunk(2, dim=-1)
        return F.linear(self._experts.act_fn(gate) * up, self._experts.down_proj[g])

    # ---- the hooks DecoderLayerOps needs: HF's own modules ----------------------------------------------------
    def attn_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf.input_layernorm(x)

    def mlp_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf.post_attention_layernorm(x)

    def shared_experts(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x)

    # ---- the ops that touch HF's attention and router (hidden states are [tokens, H], as in the seam) ----------
    @declares(writes="attn_kwargs", pinned="hf_step")
    def op_attn_prepare(self, state: State) -> None:
        step: _Step = state.hf_step
        state.attn_kwargs = {"attention_mask": step.attention_mask, "position_ids": step.position_ids,
                             self._cache_kw: step.cache, "use_cache": True,
                             "position_embeddings": step.position_embeddings}

    @declares(takes=("attn_in", "attn_kwargs"), writes="attn_out", pinned="hf_step")
    def op_attn_core(self, state: State) -> None:
        x = state.pop("attn_in")
        rows = state.hf_step.position_ids.shape[0]  # HF attention wants [rows, seq, H]
        out, _ = self.hf.self_attn(hidden_states=x.view(rows, -1, x.shape[-1]), **state.pop("attn_kwargs"))
        state.attn_out = out.reshape(x.shape)

    @declares(takes="mlp_in", writes="mlp_out")
    def op_mlp(self, state: State) -> None:
        state.mlp_out = self.hf.mlp(state.pop("mlp_in"))

    @declares(reads="mlp_in", writes="topk")
    def op_gate(self, state: State) -> None:
        _, weights, idx = self.hf.mlp.gate(state.mlp_in)
        state.topk = (idx, weights)

    @declares()  # the HF gate routes too
    def op_select_experts(self, state: State) -> None:
        """HF routers pick the experts inside the gate; nothing is left to do here."""


class _Wrapped:
    """The tbo view of one HF causal LM: wrapped layers and their bound strategies (built once, cached)."""

    def __init__(self, model: Any, backend: Any) -> None:
        self.backend = backend
        self.layers = [TboDecoderLayer(layer, backend, i) for i, layer in enumerate(model.model.layers)]
        family = self.layers[0].family
        top_k = model.config.num_experts_per_tok  # a backend whose kernels hold SMs (DeepEP V2) sizes DeepGEMM's
        # bound for every mode up front, the schedule checked against the backend's in-flight limit only for
        # the plans that split (model_forward_maybe_tbo): an unsplit prefill over DeepEP low-latency is fine
        self.strategies = {slot: strategies.bind_layers(self.layers, strategies.sized_for(
                               strategies.get(f"{family}_{slot}"), backend, top_k), num_microbatches=None)
                           for slot in Slot}


def _wrapped(model: Any, backend: Any) -> _Wrapped:
    cached = getattr(model, "_tbo_wrapped", None)
    if cached is None or cached.backend is not backend:
        cached = _Wrapped(model, backend)
        model._tbo_wrapped = cached
    return cached


def _step(mask: Any, position_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lo: int, hi: int,
          cache: Any) -> _Step:
    """Rows ``lo:hi`` of what attention needs this step."""
    m = mask[lo:hi] if isinstance(mask, torch.Tensor) else mask
    return _Step(m, position_ids[lo:hi], (cos[lo:hi], sin[lo:hi]), cache)


def _cache_rows(cache: Any, config: Any, lo: int, hi: int) -> Any:
    """A cache holding rows ``lo:hi`` of ``cache`` (the tensors are views: nothing is copied)."""
    part = _transformers().DynamicCache(config=config)
    for src, dst in zip(cache.layers, part.layers):
        if src.is_initialized:
            dst.lazy_initialization(src.keys, src.values)
            dst.keys, dst.values = src.keys[lo:hi], src.values[lo:hi]
    return part


def _join_cache_rows(cache: Any, parts: list[Any]) -> None:
    for i, layer in enumerate(cache.layers):
        pieces = [p.layers[i] for p in parts]
        if not layer.is_initialized:
            layer.lazy_initialization(pieces[0].keys, pieces[0].values)
        layer.keys = torch.cat([p.keys for p in pieces])
        layer.values = torch.cat([p.values for p in pieces])


def _rows_plan(policy: SplitPolicy, batch: int, seq: int, past: int) -> SplitPlan | None:
    """The step's split, or None. HF attention takes whole rows, so a plan that cuts inside a row runs unsplit, and
    microbatches are never padded (a padded row would not be a row)."""
    policy = policy.model_copy(update={"pad_to_multiple": 1})
    if seq == 1 and past > 0:
        plan = policy.plan(ForwardMode.DECODE, batch)
    else:
        plan = policy.plan(ForwardMode.EXTEND, batch * seq, [seq] * batch)
    # the policy rides along: ranks splitting by other rules would run other collectives (named, not mis-paired)
    if not agree_to_split(plan, config={"integration": "transformers", "policy": policy.model_dump()}) or (
            plan is None or plan.two_chunk):
        return None
    return plan


def forward(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            past_key_values: Any = None, policy: SplitPolicy | None = None, backend: Any = None,
            **run: Any) -> tuple[torch.Tensor, Any]:
    """Logits ``[batch, seq, vocab]`` and the updated cache, like ``model(input_ids, attention_mask, ...)``.

    ``attention_mask`` covers past and current tokens (as in HF generation); ``policy`` decides the split (None:
    never); ``backend`` routes the experts (default: all local). ``run`` goes to the executor (``watchdog_s``, ...).
    """
    hf = _transformers()
    backend = backend if backend is not None else LocalBackend(model.config.num_local_experts
                                                                if hasattr(model.config, "num_local_experts")
                                                                else model.config.num_experts)
    wrapped = _wrapped(model, backend)
    inner, config = model.model, model.config
    cache = past_key_values if past_key_values is not None else hf.DynamicCache(config=config)
    batch, seq = input_ids.shape
    past = cache.get_seq_length()
    with torch.no_grad():
        embeds = inner.embed_tokens(input_ids)
        if attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)[:, -seq:]
        else:
            position_ids = (torch.arange(seq) + past).unsqueeze(0).expand(batch, -1)
        make_mask = hf.masking_utils.create_causal_mask if getattr(config, "sliding_window", None) is None else (
            hf.masking_utils.create_sliding_window_causal_mask)
        mask = make_mask(config=config, inputs_embeds=embeds, attention_mask=attention_mask,
                         position_ids=position_ids, **{cache_kwarg(make_mask): cache})
        cos, sin = inner.rotary_emb(embeds, position_ids=position_ids)
        strategy = wrapped.strategies[Slot.DECODE if seq == 1 and past > 0 else Slot.PREFILL]
        plan = _rows_plan(policy, batch, seq, past) if policy is not None else None
        parts: list[Any] = []

        def pinned(mb: MicrobatchSlice | None) -> dict[str, Any]:
            if mb is None:
                return {"hf_step": _step(mask, position_ids, cos, sin, 0, batch, cache)}
            lo, hi = mb.requests_start, mb.requests_start + mb.requests_len
            parts.append(_cache_rows(cache, config, lo, hi))
            return {"hf_step": _step(mask, position_ids, cos, sin, lo, hi, parts[-1])}

        out = model_forward_maybe_tbo(wrapped.layers, {"hidden_states": embeds.view(batch * seq, -1)}, strategy, plan,
                                      pinned=pinned, backend=backend, **run)
        if parts:
            _join_cache_rows(cache, parts)
        hidden = out["hidden_states"].view(batch, seq, -1)
        logits = model.lm_head(inner.norm(hidden))
    return logits, cache


def generate(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             max_new_tokens: int = 16, policy: SplitPolicy | None = None, backend: Any = None,
             **run: Any) -> torch.Tensor:
    """Greedy decoding: the prompt with the prefill strategy, then one token per step with the decode strategy.

    Returns prompt and new tokens, like ``model.generate(do_sample=False)``; a row that emits the model's EOS is
    padded with its pad token from then on, as HF does. ``run`` goes to every step's executor, as in `forward`
    (``observer=`` sees every step's ops, ``watchdog_s``, ...).
    """
    hf = _transformers()
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    pad = getattr(gen, "pad_token_id", None)
    pad = pad if pad is not None else (min(eos_ids) if eos_ids else 0)
    cache = hf.DynamicCache(config=model.config)
    tokens, finished = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool)
    step_ids = input_ids
    for _ in range(max_new_tokens):
        logits, cache = forward(model, step_ids, mask, cache, policy, backend, **run)
        nxt = logits[:, -1].argmax(-1)
        nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
        finished |= torch.isin(nxt, torch.tensor(sorted(eos_ids), dtype=nxt.dtype)) if eos_ids else finished
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if bool(finished.all()):
            break
        step_ids = nxt[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return tokens
