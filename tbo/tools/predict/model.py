"""Model shapes (what the weights and the KV cache look like) and deployments (how a model is served).

A shape holds only what sets costs: layer counts, hidden size, the attention kind and its dimensions, and the MoE
routing (experts, their size, top-k, group-limited routing). Presets come from the models' public ``config.json``;
`ModelShape.from_hf_config` reads any other one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tbo.tools.inputs import describe_validation_error, read_json

__all__ = ["ModelShape", "Deployment", "MODELS", "get_model"]


class ModelShape(BaseModel):
    """The cost-relevant shape of a decoder-only MoE model.

    ``attention`` is ``mla`` (DeepSeek's multi-head latent attention: ``q_lora_rank``, ``kv_lora_rank``,
    ``qk_rope_dim``, ``qk_nope_dim``, ``v_head_dim``) or ``gqa`` (``num_kv_heads`` heads of ``head_dim``).
    The first ``num_dense_layers`` layers have a dense MLP of ``dense_intermediate``; the others are MoE.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    num_layers: int = Field(gt=0)
    num_dense_layers: int = Field(default=0, ge=0)
    hidden: int = Field(gt=0)
    attention: Literal["mla", "gqa"]
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(default=0, ge=0)
    head_dim: int = Field(default=0, ge=0)
    q_lora_rank: int = Field(default=0, ge=0)
    kv_lora_rank: int = Field(default=0, ge=0)
    qk_rope_dim: int = Field(default=0, ge=0)
    qk_nope_dim: int = Field(default=0, ge=0)
    v_head_dim: int = Field(default=0, ge=0)
    dense_intermediate: int = Field(default=0, ge=0)
    moe_intermediate: int = Field(gt=0)
    num_experts: int = Field(gt=0, description="routed experts")
    num_shared_experts: int = Field(default=0, ge=0)
    topk: int = Field(gt=0)
    num_groups: int = Field(default=1, gt=0, description="expert groups for group-limited routing (1: none)")
    topk_groups: int = Field(default=1, gt=0, description="groups a token may use")

    @model_validator(mode="after")
    def _check(self) -> "ModelShape":
        if self.num_dense_layers > self.num_layers:
            raise ValueError(f"num_dense_layers={self.num_dense_layers} exceeds num_layers={self.num_layers}")
        if self.topk > self.num_experts:
            raise ValueError(f"topk={self.topk} exceeds num_experts={self.num_experts}")
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_experts={self.num_experts} is not a multiple of num_groups={self.num_groups}")
        if self.topk_groups > self.num_groups:
            raise ValueError(f"topk_groups={self.topk_groups} exceeds num_groups={self.num_groups}")
        need = (("kv_lora_rank", "qk_rope_dim", "qk_nope_dim", "v_head_dim") if self.attention == "mla"
                else ("num_kv_heads", "head_dim"))
        missing = [f for f in need if getattr(self, f) <= 0]
        if missing:
            raise ValueError(f"{self.attention} attention needs {', '.join(missing)} > 0")
        if self.num_dense_layers and self.dense_intermediate <= 0:
            raise ValueError("dense layers need dense_intermediate > 0")
        return self

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | Path, name: str | None = None) -> "ModelShape":
        """A shape from a Hugging Face ``config.json`` (a dict or a path): DeepSeek-V2/V3 and Qwen2/3-MoE keys."""
        if not isinstance(config, Mapping):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            config = read_json(path, "model config")
            if not isinstance(config, Mapping):
                raise ValueError(f"model config {path}: expected a JSON object, got {type(config).__name__}")
        c = dict(config)
        label = name or c.get("_name_or_path") or c.get("model_type") or "hf-model"
        try:
            experts = c.get("n_routed_experts") or c.get("num_experts")
            if experts is None:
                raise ValueError("no n_routed_experts or num_experts: not an MoE config")
            common = dict(
                name=label, num_layers=c["num_hidden_layers"], hidden=c["hidden_size"],
                num_heads=c["num_attention_heads"], moe_intermediate=c["moe_intermediate_size"],
                num_experts=experts, topk=c["num_experts_per_tok"],
                dense_intermediate=c.get("intermediate_size", 0),
            )
            if "kv_lora_rank" in c:  # DeepSeek MLA
                return cls(**common, attention="mla", q_lora_rank=c.get("q_lora_rank") or 0,
                           kv_lora_rank=c["kv_lora_rank"], qk_rope_dim=c["qk_rope_head_dim"],
                           qk_nope_dim=c["qk_nope_head_dim"], v_head_dim=c["v_head_dim"],
                           num_dense_layers=c.get("first_k_dense_replace", 0),
                           num_shared_experts=c.get("n_shared_experts") or 0,
                           num_groups=c.get("n_group") or 1, topk_groups=c.get("topk_group") or 1)
            dense = len(c.get("mlp_only_layers") or [])
            shared = 1 if c.get("shared_expert_intermediate_size") else 0
            return cls(**common, attention="gqa", num_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
                       head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                       num_dense_layers=dense, num_shared_experts=shared)
        except KeyError as exc:
            raise ValueError(f"config {label!r} lacks key {exc.args[0]!r}") from None
        except ValidationError as exc:
            raise ValueError(f"config {label!r}: {describe_validation_error(exc)}") from None

    # ---- derived sizes ------------------------------------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def expert_params(self) -> int:
        """Parameters of one expert (gate, up and down projections)."""
        return 3 * self.hidden * self.moe_intermediate


MODELS: dict[str, ModelShape] = {
    # deepseek-ai/DeepSeek-V3 config.json (R1 shares it): num_hidden_layers 61, first_k_dense_replace 3,
    # hidden_size 7168, intermediate_size 18432, q_lora_rank 1536, kv_lora_rank 512, qk_rope_head_dim 64,
    # qk_nope_head_dim 128, v_head_dim 128, num_attention_heads 128, n_routed_experts 256,
    # moe_intermediate_size 2048, num_experts_per_tok 8, n_shared_experts 1, n_group 8, topk_group 4
    "deepseek-v3": ModelShape(
        name="deepseek-v3", num_layers=61, num_dense_layers=3, hidden=7168, attention="mla", num_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128, v_head_dim=128,
        dense_intermediate=18432, moe_intermediate=2048, num_experts=256, num_shared_experts=1, topk=8,
        num_groups=8, topk_groups=4),
    # Qwen/Qwen3-235B-A22B config.json: num_hidden_layers 94, hidden_size 4096, num_attention_heads 64,
    # num_key_value_heads 4, head_dim 128, num_experts 128, moe_intermediate_size 1536, num_experts_per_tok 8,
    # mlp_only_layers [] (every layer MoE, no shared expert)
    "qwen3-235b-a22b": ModelShape(
        name="qwen3-235b-a22b", num_layers=94, hidden=4096, attention="gqa", num_heads=64, num_kv_heads=4,
        head_dim=128, moe_intermediate=1536, num_experts=128, topk=8),
    # Qwen/Qwen3-30B-A3B config.json: num_hidden_layers 48, hidden_size 2048, num_attention_heads 32,
    # num_key_value_heads 4, head_dim 128, num_experts 128, moe_intermediate_size 768, num_experts_per_tok 8
    "qwen3-30b-a3b": ModelShape(
        name="qwen3-30b-a3b", num_layers=48, hidden=2048, attention="gqa", num_heads=32, num_kv_heads=4,
        head_dim=128, moe_intermediate=768, num_experts=128, topk=8),
}
MODELS["deepseek-r1"] = MODELS["deepseek-v3"].model_copy(update={"name": "deepseek-r1"})


def get_model(name_or_path: str | ModelShape) -> ModelShape:
    """A preset by name (case-insensitive), or a Hugging Face config.json (file or model directory)."""
    if isinstance(name_or_path, ModelShape):
        return name_or_path
    key = str(name_or_path).lower()
    if key in MODELS:
        return MODELS[key]
    path = Path(name_or_path)
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return ModelShape.from_hf_config(path, name=path.stem if path.is_file() else path.name)
    raise ValueError(f"unknown model {name_or_path!r}; known: {', '.join(sorted(MODELS))} "
                     "(or a Hugging Face config.json)")


class Deployment(BaseModel):
    """How the model is served: EP size, tokens per device, context, phase, DeepEP kernel and its SMs.

    ``tokens_per_device`` counts the tokens one GPU runs per step (decode: sequences; prefill: prompt tokens).
    ``context`` is the KV length a decode token attends to, or the prompt length in prefill (whole prompts per
    microbatch; causal attention sees half of it on average). ``kernel`` defaults by mode: DeepEP's low-latency
    kernels for decode, the normal ones for prefill; ``v2`` is DeepEP V2's unified kernels. ``comm_sms`` is the SMs the
    normal and V2 kernels take from compute while they run (DeepEP V1 ``Buffer.num_sms`` defaults to 20; V2's
    README: 12 at EP 8x2, 6 at EP 8x4; on one rank V2's ``get_theoretical_num_sms`` gives every SM, see
    `comm_sms_of`); low-latency kernels hold no SMs while in flight. ``expert_slots``
    (default: the model's experts) counts physical expert copies, e.g. 288 with EPLB's 32 redundant experts.
    ``balancedness`` is mean over max expert load per GPU (SGLang's measure): the busiest GPU sets the pace.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ep: int = Field(gt=0)
    tokens_per_device: int = Field(gt=0)
    context: int = Field(gt=0)
    mode: Literal["decode", "prefill"] = "decode"
    kernel: Literal["low_latency", "normal", "v2"] | None = None
    comm_sms: int | None = Field(default=None, ge=0)
    expert_slots: int | None = Field(default=None, gt=0)
    weight_dtype: Literal["fp8", "bf16"] = "fp8"
    kv_bytes: float = Field(default=2.0, gt=0, allow_inf_nan=False, description="bytes per KV-cache element (2: BF16, 1: FP8)")
    dispatch_dtype: Literal["fp8", "bf16"] = "fp8"
    balancedness: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)

    @property
    def resolved_kernel(self) -> Literal["low_latency", "normal", "v2"]:
        if self.kernel is not None:
            return self.kernel
        return "low_latency" if self.mode == "decode" else "normal"

    @property
    def resolved_comm_sms(self) -> int:
        if self.comm_sms is not None:
            return self.comm_sms
        return {"low_latency": 0, "normal": 20, "v2": 12 if self.ep <= 16 else 6}[self.resolved_kernel]

    def takes_whole_device(self) -> bool:
        """V2 on one rank (EP1) with no ``comm_sms`` of the user's: no traffic to size by, so
        ``get_theoretical_num_sms`` returns every SM (DeepEP elastic.py:816-818). The one case where DeepEP's
        kernels hold the whole device; an SM count the user gave is never it (`check_sms` refuses one too large)."""
        return self.comm_sms is None and self.resolved_kernel == "v2" and self.ep == 1

    def comm_sms_of(self, device_sms: int) -> int:
        """``resolved_comm_sms`` on a device of ``device_sms`` SMs (every SM when `takes_whole_device`)."""
        return device_sms if self.takes_whole_device() else self.resolved_comm_sms

    def check_sms(self, device_sms: int, device: str) -> None:
        """Refuse a ``comm_sms`` the device cannot give: more SMs than it has, or all of them (none left for the
        compute that TBO overlaps with communication)."""
        if self.comm_sms is not None and self.comm_sms >= device_sms:
            raise ValueError(f"comm_sms (--comm-sms) = {self.comm_sms}, but {device} has {device_sms} SMs: DeepEP's "
                             f"kernels must leave some to compute (at most {device_sms - 1}; DeepEP V1's default is "
                             f"20)")

    def slots(self, model: ModelShape) -> int:
        n = self.expert_slots or model.num_experts
        if n % self.ep:
            raise ValueError(f"expert slots ({n}) must be a multiple of ep={self.ep}; set expert_slots "
                             f"(e.g. {(n // self.ep + 1) * self.ep}) for redundant experts")
        return n
