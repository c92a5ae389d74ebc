"""`TboConfig`: tbo's settings in any engine, one schema, validated before the engine runs a step.

One schema for every engine, so a deployment moves between them with the same keys: vLLM reads it from
``additional_config["tbo"]``, SGLang from ``TBO_SGLANG_CONFIG``, a third engine from wherever its operators put
settings. Every key is checked here (pydantic, ``extra="forbid"``); `describe_error` turns a mistake into one line per
key naming the key, the value and what is accepted, which each engine raises as its own error while it starts: a typo
must never become a silent run without TBO. What an engine cannot run of the schema (SGLang: DeepEP, AFD) it refuses
beside its own parser, by name. This module imports no engine, so the schema is tested without one.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tbo import strategies
from tbo.afd.group import parse_address
from tbo.comm.emulated import parse_link_spec
from tbo.core.dataflow import closest_names
from tbo.split import SplitPolicy
from tbo.split.adaptive import AdaptiveConfig
from tbo.split.kinds import Slot

__all__ = ["AFDSettings", "StrategyNames", "TboConfig", "describe_error"]


class AFDSettings(BaseModel):
    """The ``afd`` key: where the FFN server is, and how long the attention side waits for it (an engine that
    cannot run attention-FFN disaggregation refuses the key by name)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ffn: str = Field(description="the FFN server's HOST:PORT (`tbo afd-ffn --listen HOST:PORT`)")
    timeout_s: float = Field(default=30.0, gt=0, description="deadline of every wait for an FFN result")
    connect_timeout_s: float = Field(default=10.0, gt=0, description="deadline to reach the FFN server at start")
    transport: Literal["auto", "tcp", "gloo", "nccl"] = Field(
        default="auto", description="'auto': on CPU the authenticated connection itself ('tcp'; 'gloo' is read as "
                                    "it), NCCL on CUDA")
    token: str | None = Field(default=None, repr=False, min_length=1,
                              description="the shared secret the FFN server requires (its --token); default: the "
                                          "TBO_AFD_TOKEN environment variable at engine start")
    integrity: Literal["headers", "full"] = Field(
        default="headers", description="with a secret: what each frame's MAC covers after the join, 'headers' "
                                       "(headers and small messages, not the hidden states; the default) or 'full' "
                                       "(every byte); the pair runs the stronger of the engine's and the server's")
    refuse_nonfinite: bool = Field(default=False, description="refuse, by name, an FFN answer holding a NaN or an "
                                                              "inf (reads every answer once more)")

    @field_validator("ffn")
    @classmethod
    def _address(cls, value: str) -> str:
        parse_address(value, "the FFN server address")
        return value

    def backend_for(self, platform: str) -> str:
        if self.transport != "auto":
            return self.transport
        return "nccl" if platform == "cuda" else "tcp"


class StrategyNames(BaseModel):
    """The registry names of the strategy for decode-only steps and for steps with prefill."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decode: str
    prefill: str

    def of(self, slot: Slot) -> str:
        """The name in ``slot``."""
        return self.decode if slot == Slot.DECODE else self.prefill


def _check_strategy_name(name: str) -> str:
    if name not in strategies.names():
        close = closest_names(name, strategies.names())
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"strategy {name!r} is not registered; accepted: 'auto' or one of "
                         f"{', '.join(strategies.names())} (your own: the 'strategies' key, by value, or "
                         f"'strategy_modules', modules that register them){hint}")
    return name


class TboConfig(BaseModel):
    """tbo's settings in an engine (vLLM's ``additional_config["tbo"]``, SGLang's ``TBO_SGLANG_CONFIG``). Every key
    is optional; ``{}`` turns TBO on with the defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Any = Field(
        default="auto", description="'auto' (decode and prefill strategies from the layers' structure), one registered "
                                    "name for both, or {'decode': name, 'prefill': name}")
    num_microbatches: int = Field(default=2, description="microbatches per split step")
    # vLLM DBO's defaults (ParallelConfig.dbo_*_token_threshold): below them a split step on a GPU mostly reads the
    # weights twice, and the all-to-all it would hide is latency-bound anyway. CPU tests and demos set their own.
    decode_token_threshold: int = Field(default=32, description="a decode-only step splits from this many tokens")
    prefill_token_threshold: int = Field(default=512, description="a step with prefill splits from this many tokens")
    split: Literal["static", "adaptive"] = Field(
        default="static", description="'static': a step splits from the token thresholds; 'adaptive': where its "
                                      "kind and size were measured to pay (tbo.split.adaptive; thresholds you set "
                                      "seed it), choosing among unsplit and the decode and prefill strategies")
    adaptive: AdaptiveConfig | None = Field(
        default=None, description="split 'adaptive' only: how it explores and decides (warmup_samples, warmup_slack, "
                                  "explore_share, explore_cost, hysteresis, window, microbatches, strategies, "
                                  "prior_slack, trust_below)")
    token_distribution_threshold: float = Field(
        default=SplitPolicy.model_fields["token_distribution_threshold"].default,
        description="below this share on one side of a request boundary, cut inside a request")
    allow_cut_sequences: bool = Field(default=True, description="False: cut only between requests")
    pad_to_multiple: Literal[1] = Field(default=1, description="an engine's microbatches are exact token ranges: 1 only")
    backend: Literal["local", "deepep"] = Field(
        default="local", description="'local': tbo's own all-to-all (every expert on this rank, TP sharding them; "
                                     "with data parallel + expert parallel, over the engine's expert-parallel "
                                     "group: gloo on a CPU, NCCL on CUDA); 'deepep': DeepEP over that group (CUDA only)")
    deepep_kind: Literal["auto", "v2", "v1_normal"] = Field(
        default="auto", description="which DeepEP for steps with prefill (NORMAL layout: vLLM's experts kernel takes "
                                    "per-token top-k)")
    deepep_decode: Literal["auto", "low_latency", "normal"] = Field(
        default="auto", description="DeepEP for decode steps: 'low_latency' (V1 low-latency kernels, MASKED layout, "
                                    "vLLM's batched experts kernel; bf16 models of a hidden size they are compiled "
                                    "for), 'normal' (as prefill), 'auto' (low-latency where the model allows it)")
    fp8_dispatch: bool | Literal["auto"] = Field(
        default="auto", description="'auto': with backend 'deepep', the dispatch carries FP8 rows with their scales "
                                    "where every MoE layer's quant method takes them (DeepSeek's block FP8, per-token "
                                    "groups of 128), quantised by that method's own quantiser; True: required, "
                                    "refused by name where not; False: the model's dtype always")
    link: str | None = Field(default=None, description="emulated link 'LATENCY_US,GBPS' around the backend "
                                                        "(tbo.comm.EmulatedLink), or with afd between the engine "
                                                        "and the FFN server (tbo.afd.link): makes overlap visible "
                                                        "on a CPU")
    afd: AFDSettings | None = Field(default=None, description="attention-FFN disaggregation: {'ffn': "
                                      "'HOST:PORT', ...}; the FFN runs in `tbo afd-ffn` (docs/vllm-afd.md)")
    comm_timeout_s: float = Field(default=60.0, gt=0, description="data parallel + expert parallel: the deadline "
                                  "of every wait on another rank (a dead or stalled peer is a named error)")
    agreed_rows: bool = Field(default=True, description="data parallel + expert parallel: each dispatch sends by "
                              "the token rows every rank agreed for the step, padded, with no row-count exchange; "
                              "False: each dispatch first exchanges row counts with its peers (blocking)")
    op_times: bool = Field(default=False, description="add each op's wall time to stats() (op_seconds, op_calls): "
                           "where a step's time goes, a *_b op's time being a wait the overlap left exposed")
    stats_file: str | None = Field(default=None, description="each worker writes its stats() as JSON here "
                                                             "after every counted step (replaced whole) and "
                                                             "at shutdown; '{rank}' is replaced by its rank in the "
                                                             "engine's world (DP rank * TP size + TP rank)")
    metrics: bool = Field(default=True, description="publish each worker's stats to the engine's /metrics (vLLM: "
                          "through the tbo stat-logger plugin, entry point vllm.stat_logger_plugins): a background "
                          "thread overwrites a fixed-size shared-memory slot every metrics_interval_s "
                          "(docs/metrics.md)")
    metrics_interval_s: float = Field(default=1.0, gt=0, le=3600, description="seconds between two publishes of "
                                      "a worker's stats to its metrics slot (a scrape lags by at most this)")
    strategies: dict[str, Any] = Field(
        default_factory=dict, description="your own strategies by value: name -> the JSON "
                                          "OperationsStrategy.model_dump_json() writes (or that JSON as an object), "
                                          "registered in every engine process; `strategy` names them")
    strategy_modules: list[str] = Field(
        default_factory=list, description="modules imported in every engine process before the strategy is resolved, "
                                          "which register strategies (tbo.strategies.register)")

    @model_validator(mode="before")
    @classmethod
    def _register_strategies(cls, data: Any) -> Any:
        """Register the config's own strategies in this process first, so that `strategy` can name them: an engine hands
        its config to every process it starts (vLLM's ``additional_config``, SGLang's environment), which is how they
        reach the processes that run the model."""
        if isinstance(data, Mapping):
            strategies.register_from_config(data.get("strategies"), data.get("strategy_modules"))
        return data

    @field_validator("strategy", mode="before")
    @classmethod
    def _strategy(cls, value: Any) -> str | StrategyNames:
        if isinstance(value, Mapping):
            if set(value) != set(Slot):
                raise ValueError(f"a strategy dict needs exactly the keys 'decode' and 'prefill', got {sorted(value)}")
            value = StrategyNames(**value)
        if isinstance(value, StrategyNames):
            _check_strategy_name(value.decode)
            _check_strategy_name(value.prefill)
        elif not isinstance(value, str):
            raise ValueError("strategy must be 'auto', a registered name, or {'decode': name, 'prefill': name}")
        elif value != "auto":
            _check_strategy_name(value)
        return value

    @model_validator(mode="after")
    def _adaptive_only_when_adaptive(self) -> "TboConfig":
        if self.adaptive is not None and self.split != "adaptive":
            raise ValueError("'adaptive' settings are read only with split='adaptive'; this config splits "
                             f"{self.split!r}")
        return self

    @model_validator(mode="after")
    def _candidate_strategies(self) -> "TboConfig":
        """Every name ``adaptive.strategies`` gives is registered (built in, or by value through ``strategies``):
        refused here, by name, before an engine starts; binding it to the layers is the engine's check."""
        for name in ([] if self.adaptive is None else self.adaptive.strategy_names()):
            try:
                _check_strategy_name(name)
            except ValueError as e:
                raise ValueError(f"adaptive.strategies: {e}".replace("accepted: 'auto' or one of", "accepted: one of")
                                 ) from None
        return self

    @field_validator("link")
    @classmethod
    def _link(cls, value: str | None) -> str | None:
        if value is not None:
            parse_link_spec(value)  # the link's own parser: its ValueError names the spec
        return value

    def split_policy(self) -> SplitPolicy:
        """The `SplitPolicy` these keys describe (its own checks apply: thresholds >= num_microbatches, ...)."""
        return SplitPolicy(num_microbatches=self.num_microbatches, decode_token_threshold=self.decode_token_threshold,
                           prefill_token_threshold=self.prefill_token_threshold,
                           token_distribution_threshold=self.token_distribution_threshold,
                           pad_to_multiple=self.pad_to_multiple, allow_cut_sequences=self.allow_cut_sequences)

    def strategy_names(self, shared_experts: bool, *, dense: bool = False, tensor_parallel: bool = False,
                       expert_parallel: bool = False) -> StrategyNames:
        """The registry names to run. ``"auto"`` follows the layers' structure (`tbo.strategies.auto_names`): under
        tensor parallelism (``tensor_parallel``: the engine runs the layers' all-reduces as transfers) the TP
        strategies, ``dense_tp_*`` for a model with no MoE layer (``dense``) and ``moe_tp_*`` for one with
        (``moe_tp_ep_*`` where its experts are spread whole over the TP ranks, ``expert_parallel``); otherwise,
        with a shared expert (in any MoE layer) the strategies that overlap it with the dispatch (``deepseek_decode``,
        ``deepseek_prefill``), without one the same shapes less that op (``qwen3_moe_decode``,
        ``qwen3_moe_prefill``)."""
        if isinstance(self.strategy, StrategyNames):
            return self.strategy
        if self.strategy == "auto":
            names = strategies.auto_names(moe=not dense, shared_experts=shared_experts,
                                          tensor_parallel=tensor_parallel, expert_parallel=expert_parallel)
            return StrategyNames(decode=names.decode, prefill=names.prefill)
        return StrategyNames(decode=self.strategy, prefill=self.strategy)


def describe_error(error: ValidationError) -> str:
    """A pydantic error on the schema as one line per key: an unknown key with the accepted ones, a bad value with
    why. Each engine prefixes it with where the settings came from."""
    lines = []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"]) or "tbo"
        if e["type"] == "extra_forbidden":
            nested = {"adaptive": AdaptiveConfig, "afd": AFDSettings}.get(str(e["loc"][0])) if len(e["loc"]) > 1 \
                else None
            accepted = ", ".join((nested or TboConfig).model_fields)
            lines.append(f"unknown key {where!r}; accepted keys: {accepted}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{where}={e.get('input')!r}: {msg}" if e["loc"] else msg)
    return "; ".join(lines)
