"""`AFDVllmConfig`: ``additional_config["tbo"]["afd"]``, and what an AFD engine refuses.

The key's schema is every engine's (`tbo.integrations.engine.config.AFDSettings`); what vLLM refuses of it is here.
Imports no vLLM, so that it is checked (and tested) without it, like `TboVllmConfig` around it.
"""

from __future__ import annotations

from typing import Any

from tbo.integrations.engine.config import AFDSettings

__all__ = ["AFDVllmConfig", "AFD_STRATEGY", "check_afd_engine"]

#: the op list every AFD step runs (tbo.strategies.afd): attention, send, Yield, receive
AFD_STRATEGY = "afd_attention_dbo"


#: ``additional_config["tbo"]["afd"]``: the schema's `AFDSettings`, under its vLLM name
AFDVllmConfig = AFDSettings


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
