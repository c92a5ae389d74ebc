"""tbo inside vLLM: a general plugin that runs vLLM's own MoE models (every decoder layer whose MoE is a `MoERunner`)
through tbo strategies.

Installing tbo installs the plugin (entry point ``vllm.general_plugins``); it does nothing until an engine is given
``additional_config={"tbo": {...}}`` (`TboVllmConfig` lists the keys). Then the engine's steps are split by tbo's
`SplitPolicy`, vLLM builds each microbatch's attention metadata with its own builders, and the decoder layers run as
tbo ops overlapped by the strategy. `stats` says what happened in this process. See docs/vllm.md.

vLLM is imported only where an engine needs it; this package imports without it.
"""

from tbo.integrations.vllm.config import CONFIG_KEY, TboConfigError, TboVllmConfig, parse_config
from tbo.integrations.vllm.stats import reset_stats, stats

__all__ = ["CONFIG_KEY", "TboConfigError", "TboVllmConfig", "parse_config", "reset_stats", "stats"]
