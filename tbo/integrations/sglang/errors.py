"""The SGLang plugin's one error type and its one message shape: what a refused engine is told.

SGLang has no per-engine extension config like vLLM's ``additional_config``, so tbo's switch is the environment
variable `ENV` (the same JSON as vLLM's ``additional_config["tbo"]``). A configuration or model tbo cannot run must
fail the engine's start naming the culprit and what is accepted: every message here reads ``TBO_SGLANG_CONFIG with
<settings>: <detail>``, a refusal's detail ``not supported (<why>); accepted: <accepted>`` (`refuse`). The type and
the shape are every engine's (`tbo.integrations.engine.errors.TboEngineError`); `TboSglangError` is SGLang's name for
it. This module imports nothing of SGLang or pydantic, so every module of the room can raise it.
"""

from __future__ import annotations

from typing import Any, Mapping, NoReturn

from tbo.integrations.engine.errors import TboEngineError

__all__ = ["ENV", "TboSglangError", "config_error", "refuse"]

#: the environment variable holding the JSON config; unset: the plugin stays idle
ENV = "TBO_SGLANG_CONFIG"


class TboSglangError(TboEngineError):
    """``TBO_SGLANG_CONFIG``, or the engine or model it was given to, is something tbo cannot run; the message names
    the culprit and what is accepted."""

    source = ENV


def config_error(settings: str | Mapping[str, Any], detail: str) -> TboSglangError:
    """``TBO_SGLANG_CONFIG with <settings>: <detail>``."""
    return TboSglangError.about(settings, detail)


def refuse(settings: str | Mapping[str, Any], accepted: str, why: str) -> NoReturn:
    """Refuse ``settings``: ``TBO_SGLANG_CONFIG with <settings>: not supported (<why>); accepted: <accepted>``."""
    TboSglangError.refuse(settings, accepted, why)
