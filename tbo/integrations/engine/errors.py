"""The one error type of every engine integration, and its one message shape: what a refused engine is told.

A configuration, deployment or model tbo cannot run must fail the engine's start naming the culprit and what is
accepted. Every such message reads ``<source> with <settings>: <detail>``, where ``<source>`` names where this
engine's settings come from (vLLM's ``additional_config['tbo']``, SGLang's ``TBO_SGLANG_CONFIG``), and a refusal's
detail is ``not supported (<why>); accepted: <accepted>`` (`TboEngineError.refuse`). Each engine room raises it
under its own name, a subclass that sets `TboEngineError.source`, so its users catch what they know, and code that
serves every engine catches `TboEngineError`. This module imports nothing of an engine or pydantic, so that every
module of a room can raise it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, NoReturn, TypeVar

__all__ = ["ON", "TboEngineError", "describe_settings"]


class _On:
    """A setting named without a value (``afd``: the feature is on)."""

    def __repr__(self) -> str:
        return "ON"


#: a setting named without a value (`describe_settings` writes its name alone)
ON: Any = _On()


def describe_settings(settings: str | Mapping[str, Any]) -> str:
    """``{"a": 1, "b": "x"}`` as ``a=1 and b='x'`` (a setting whose value is `ON` by its name alone); a string is
    taken as written."""
    if isinstance(settings, str):
        return settings
    return " and ".join(name if value is ON else f"{name}={value!r}" for name, value in settings.items())


_E = TypeVar("_E", bound="TboEngineError")


class TboEngineError(ValueError):
    """tbo's settings, or the engine or model they were given to, are something tbo cannot run; the message names the
    culprit and what is accepted. An engine room subclasses it, naming its settings' `source`."""

    #: where the engine's settings come from: the head of every message of this type
    source: ClassVar[str] = "tbo's settings"

    @classmethod
    def about(cls: type[_E], settings: str | Mapping[str, Any], detail: str) -> _E:
        """``<source> with <settings>: <detail>`` (``settings`` as `describe_settings` writes them)."""
        return cls(f"{cls.source} with {describe_settings(settings)}: {detail}")

    @classmethod
    def refuse(cls, settings: str | Mapping[str, Any], accepted: str, why: str) -> NoReturn:
        """Refuse ``settings``: ``<source> with <settings>: not supported (<why>); accepted: <accepted>``."""
        raise cls.about(settings, f"not supported ({why}); accepted: {accepted}")
