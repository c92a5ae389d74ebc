"""The SGLang plugin's entry point (group ``sglang.srt.plugins``): idle unless ``TBO_SGLANG_CONFIG`` is set.

SGLang calls `register` in every process it starts (the engine's, the scheduler's, the detokenizer's) and swallows
what a plugin raises there, so `register` does nothing that can fail and reads no config: it only hooks
``ModelRunner.initialize`` (SGLang's own `HookRegistry`, AFTER). When a runner has loaded its model, in the process
that runs it, the hook reads ``TBO_SGLANG_CONFIG``: unset or empty, it returns at once and SGLang runs as without
tbo; set, tbo is built on that runner (`SglangEngine`), and a bad key, a refused deployment or a model tbo cannot
serve fails the runner's start, naming the culprit: never a silent run without TBO.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["TARGET", "engine_of", "register"]

logger = logging.getLogger("sglang.tbo")

#: the method whose end builds tbo on a runner
TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.initialize"
_ATTR = "_tbo_engine"


def register() -> None:
    """Hook ``ModelRunner.initialize``; called by SGLang's plugin loader in every process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _after_initialize, HookType.AFTER)


def _after_initialize(result: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    from tbo.integrations.sglang.config import read

    config = read()  # at engine start, in the process that runs the model; never at import
    if config is None or getattr(runner, "is_draft_worker", False):
        return result
    from tbo.integrations.sglang.runner.engine import SglangEngine

    setattr(runner, _ATTR, SglangEngine(runner, config))
    return result


def engine_of(runner: Any) -> Any:
    """The `SglangEngine` on ``runner`` (None: tbo is off there)."""
    return getattr(runner, _ATTR, None)
