"""The plugin's one error type and its one message shape: what a refused engine is told.

A configuration tbo cannot run must fail the engine's start naming the culprit and what is accepted; every such
message here reads ``additional_config['tbo'] with <settings>: <detail>``, and a refusal's detail is ``not supported
(<why>); accepted: <accepted>`` (`refuse`). This module imports nothing of vLLM or pydantic, so that any module of the
plugin, and the AFD config beneath the schema, can raise it without importing the schema.
"""

from __future__ import annotations

from typing import Any, Mapping, NoReturn

__all__ = ["CONFIG_KEY", "ON", "TboConfigError", "config_error", "describe_settings", "refuse"]

#: the key of ``additional_config`` the plugin reads
CONFIG_KEY = "tbo"


class TboConfigError(ValueError):
    """``additional_config["tbo"]``, or the engine it was given to, is something tbo cannot run; the message names
    the culprit and what is accepted."""


class _On:
    """A setting named without a value (``afd``: the feature is on)."""

    def __repr__(self) -> str:
        return "ON"


ON: Any = _On()


def describe_settings(settings: str | Mapping[str, Any]) -> str:
    """``{"a": 1, "b": "x"}`` as ``a=1 and b='x'`` (a setting whose value is `ON` by its name alone); a string is
    taken as written."""
    if isinstance(settings, str):
        return settings
    return " and ".join(name if value is ON else f"{name}={value!r}" for name, value in settings.items())


def config_error(settings: str | Mapping[str, Any], detail: str) -> TboConfigError:
    """The `TboConfigError` for ``settings`` (`describe_settings`): ``additional_config['tbo'] with <settings>:
    <detail>``."""
    return TboConfigError(f"additional_config[{CONFIG_KEY!r}] with {describe_settings(settings)}: {detail}")


def refuse(settings: str | Mapping[str, Any], accepted: str, why: str) -> NoReturn:
    """Refuse ``settings``: ``additional_config['tbo'] with <settings>: not supported (<why>); accepted:
    <accepted>``."""
    raise config_error(settings, f"not supported ({why}); accepted: {accepted}")
