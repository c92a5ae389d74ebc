"""`AFDVllmConfig`: ``additional_config["tbo"]["afd"]``, and what an AFD engine refuses.

Imports no vLLM, so that the schema is checked (and tested) without it, like `TboVllmConfig` around it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tbo.afd.group import parse_address

__all__ = ["AFDVllmConfig", "AFD_STRATEGY", "check_afd_engine"]

#: the op list every AFD step runs (tbo.strategies.afd): attention, send, Yield, receive
AFD_STRATEGY = "afd_attention_dbo"


class AFDVllmConfig(BaseModel):
    """Where the FFN server is, and how long the attention side waits for it."""

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


def check_afd_engine(vllm_config: Any, config: Any) -> None:
    """Refuse what an AFD engine cannot run, naming the setting (``config``: the whole `TboVllmConfig`)."""
    from tbo.integrations.vllm.errors import ON
    from tbo.integrations.vllm.errors import refuse as refuse_settings

    def refuse(setting: str, value: Any, accepted: str, why: str) -> None:
        refuse_settings({"afd": ON, setting: value}, accepted, why)

    if config.strategy not in ("auto", AFD_STRATEGY):
        refuse("strategy", config.strategy, f"'auto' or {AFD_STRATEGY!r}",
               "an AFD layer's ops are attention, afd_send, Yield, afd_recv: the FFN runs on the FFN server")
    if config.backend != "local":
        refuse("backend", config.backend, "'local' (a link emulates the engine-server wire)",
               "the experts run on the FFN server; nothing is dispatched on the attention side")
    from tbo.afd.config import AFD_MICROBATCH_COUNTS

    if config.num_microbatches not in AFD_MICROBATCH_COUNTS:
        refuse("num_microbatches", config.num_microbatches, ", ".join(map(str, AFD_MICROBATCH_COUNTS)),
               "an AFD step is split into 2 (the seed's DBO), 3 or 4 microbatches")
    par = vllm_config.parallel_config
    tp = par.tensor_parallel_size
    if tp != 1:
        refuse("tensor_parallel_size", tp, "1", "one attention rank talks to one FFN server")
    if par.data_parallel_size != 1 or par.enable_expert_parallel:
        refuse("data_parallel_size/enable_expert_parallel", (par.data_parallel_size, par.enable_expert_parallel),
               "1, False", "the experts run on the FFN server, not spread over the engine's ranks")
