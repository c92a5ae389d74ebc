"""The SGLang plugin's config: the JSON in ``TBO_SGLANG_CONFIG``, every engine's schema (vLLM's
``additional_config["tbo"]``).

One schema for every engine, so a deployment moves between them with the same keys: the kit's
`tbo.integrations.engine.config.TboConfig` checks it, every key by name, a typo refused with the accepted keys.
What the SGLang integration cannot run yet (DeepEP, AFD, FP8 dispatch) is refused here by name, never ignored. The
variable is read when a process that runs the model starts its engine (`read`), never at import.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from pydantic import ValidationError

from tbo.integrations.sglang.errors import ENV, TboSglangError, refuse
from tbo.integrations.engine.config import TboConfig, describe_error

__all__ = ["TboSglangConfig", "parse_config", "read"]

#: the schema, every engine's (the keys and their checks are the same as vLLM's)
TboSglangConfig = TboConfig


def read(environ: Mapping[str, str] | None = None) -> TboSglangConfig | None:
    """The config in ``TBO_SGLANG_CONFIG`` (of ``environ``, default the process's), or None when unset or empty
    (the plugin stays idle)."""
    text = (os.environ if environ is None else environ).get(ENV)
    if text is None or not text.strip():
        return None
    return parse_config(text)


def parse_config(text: str | Mapping[str, Any]) -> TboSglangConfig:
    """Parse and check the JSON text (or its object); `TboSglangError` names every bad key and what is accepted."""
    raw: Any = text
    if isinstance(text, str):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise TboSglangError(f"{ENV} is not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(raw, Mapping):
        raise TboSglangError(f"{ENV} must hold a JSON object of tbo settings, got {type(raw).__name__} {raw!r}; "
                             f"accepted keys: {', '.join(TboSglangConfig.model_fields)}")
    try:
        config = TboSglangConfig(**raw)
        config.split_policy()
    except ValidationError as e:
        raise TboSglangError(f"{ENV}: {describe_error(e)}") from None
    _check_supported(config)
    return config


def _check_supported(config: TboSglangConfig) -> None:
    """Keys of the shared schema whose features the SGLang integration does not run (yet): refused by name."""
    if config.backend != "local":
        refuse({"backend": config.backend}, "backend 'local' (tbo's all-to-all; 'link' emulates an interconnect)",
               "DeepEP inside SGLang needs SGLang's expert-parallel groups, which tbo does not drive yet")
    if config.afd is not None:
        refuse("afd", "no 'afd' key", "attention-FFN disaggregation runs inside vLLM only")
    if config.fp8_dispatch is True:
        refuse({"fp8_dispatch": True}, "'auto' or false", "FP8 dispatch needs DeepEP")
