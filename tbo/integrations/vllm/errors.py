"""The plugin's one error type and its one message shape: what a refused engine is told.

A configuration tbo cannot run must fail the engine's start naming the culprit and what is accepted; every such
message here reads ``additional_config['tbo'] with <settings>: <detail>``, and a refusal's detail is ``not supported
(<why>); accepted: <accepted>`` (`refuse`). The type and the shape are every engine's
(`tbo.integrations.engine.errors.TboEngineError`); `TboConfigError` is vLLM's name for it. This module imports nothing
of vLLM or pydantic, so that any module of the plugin, and the AFD config beneath the schema, can raise it without
importing the schema.
"""

from __future__ import annotations

from typing import Any, Mapping, NoReturn

from tbo.integrations.engine.errors import ON, TboEngineError, describe_settings

__all__ = ["CONFIG_KEY", "ON", "TboConfigError", "config_error", "describe_settings", "refuse"]

#: the key of ``additional_config`` the plugin reads
CONFIG_KEY = "tbo"


class TboConfigError(TboEngineError):
    """``additional_config["tbo"]``, or the engine it was given to, is something tbo cannot run; the message names
    the culprit and what is accepted."""

    source = f"additional_config[{CONFIG_KEY!r}]"


def config_error(settings: str | Mapping[str, Any], detail: str) -> TboConfigError:
    """The `TboConfigError` for ``settings`` (`describe_settings`): ``additional_config['tbo'] with <settings>:
    <detail>``."""
    return TboConfigError.about(settings, detail)


def refuse(settings: str | Mapping[str, Any], accepted: str, why: str) -> NoReturn:
    """Refuse ``settings``: ``additional_config['tbo'] with <settings>: not supported (<why>); accepted:
    <accepted>``."""
    TboConfigError.refuse(settings, accepted, why)
