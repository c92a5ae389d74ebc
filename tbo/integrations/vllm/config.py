"""`TboVllmConfig`: what ``additional_config={"tbo": {...}}`` may say, validated before the engine runs a step.

The plugin does nothing for an engine without a ``"tbo"`` entry. With one, every key is checked (the engine-neutral
schema, `tbo.integrations.engine.config.TboConfig`, which `TboVllmConfig` names here) and a mistake is a
`TboConfigError` that names the key, the value and what is accepted, raised while the engine starts: a typo must
never become a silent run without TBO. This module imports no vLLM, so the schema is tested without it.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import ValidationError

from tbo.integrations.engine.config import StrategyNames, TboConfig, describe_error
from tbo.integrations.vllm.errors import CONFIG_KEY, TboConfigError

__all__ = ["TboConfigError", "TboVllmConfig", "StrategyNames", "describe_error", "parse_config", "CONFIG_KEY"]

#: the schema of ``additional_config["tbo"]``: every engine's (`TboConfig`), under the name vLLM's users know
TboVllmConfig = TboConfig


def parse_config(additional_config: Any) -> TboVllmConfig | None:
    """The tbo config in vLLM's ``additional_config``, or None when it has no ``"tbo"`` key (the plugin stays off).

    Raises `TboConfigError` naming every bad key and what is accepted.
    """
    if not isinstance(additional_config, Mapping) or CONFIG_KEY not in additional_config:
        return None
    raw = additional_config[CONFIG_KEY]
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise TboConfigError(f"additional_config['tbo'] must be a dict of tbo settings, got "
                             f"{type(raw).__name__} {raw!r}; accepted keys: {', '.join(TboVllmConfig.model_fields)}")
    try:
        config = TboVllmConfig(**raw)
        config.split_policy()
    except ValidationError as e:
        raise TboConfigError(f"additional_config['tbo']: {describe_error(e)}") from None
    return config
