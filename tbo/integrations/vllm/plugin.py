"""The vLLM general plugin (entry point ``vllm.general_plugins``: ``tbo = tbo.integrations.vllm.plugin:register``).

vLLM calls `register` in every process it starts. It makes two changes, and only those, each doing nothing for an
engine whose ``additional_config`` has no ``"tbo"`` key:

* the model runners' ``load_model`` is wrapped, on every runner class vLLM builds (V1's and Model Runner V2's, GPU
  and CPU: `RUNNER_CLASSES`), so that the config and the engine are checked before the weights load (`check_engine`:
  a bad key, strategy, architecture, parallel setting or vLLM version fails the engine's start, naming it; on V2
  also what tbo does not run there yet, `tbo.integrations.vllm.admit.runners.check_v2`; a runner of neither kind is
  refused by name) and tbo is installed on that runner after (`TboEngine`, or `V2Engine` on Model Runner V2). A
  runner class that cannot be wrapped is logged; an engine it builds with tbo's config then fails at start, naming
  it (`tbo.integrations.vllm.admit.runners`), as no runner may serve tbo's config silently unsplit;
* with data parallelism, the engine core's ``_has_global_unfinished_reqs`` (vLLM's engine-loop all-reduce over the
  DP ranks, every ``dp_sync_interval`` steps, that ends a wave of steps) waits at most ``comm_timeout_s`` and names a
  stalled or lost peer, as every other wait on a peer does, and counts the requests still in the engine core's
  input queue as unfinished (`tbo.integrations.vllm.runner.dp.bounded_engine_sync`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from tbo.integrations.vllm.admit.runners import REFUSED_RUNNER_CLASSES, V1_RUNNER_CLASSES, V2_RUNNER_CLASSES
from tbo.integrations.vllm.config import parse_config

__all__ = ["register", "RUNNER_CLASSES"]

logger = logging.getLogger("vllm.tbo")

#: (module, class) of the model runners whose ``load_model`` the plugin wraps where the class defines it: V1's (the
#: CPU runner overrides it), Model Runner V2's (its subclasses inherit the GPU runner's, wrapped), and those tbo
#: refuses by name (0.34's standalone CPU runner)
RUNNER_CLASSES = V1_RUNNER_CLASSES + V2_RUNNER_CLASSES + REFUSED_RUNNER_CLASSES
#: (module, class, method) of vLLM's data-parallel engine-loop all-reduce, which the plugin bounds
DP_ENGINE_SYNC = ("vllm.v1.engine.core", "DPEngineCoreProc", "_has_global_unfinished_reqs")
_MARK = "__tbo_wrapped__"


def register() -> None:
    """Wrap the model runners' ``load_model`` (once per process: vLLM may call this several times)."""
    import importlib

    for module_name, class_name in RUNNER_CLASSES:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except ModuleNotFoundError as e:  # a release without that runner's module (V1 on 0.34): it cannot build it
            if e.name is not None and (module_name + ".").startswith(e.name + "."):
                logger.debug("tbo plugin: vLLM has no %s.%s (%s)", module_name, class_name, e)
                continue
            logger.warning("tbo plugin: cannot wrap %s.%s (%s); an engine it serves with additional_config['tbo'] "
                           "is refused by name", module_name, class_name, e)
            continue
        except (ImportError, AttributeError) as e:  # the module is there but the runner is not: an engine asking
            logger.warning("tbo plugin: cannot wrap %s.%s (%s); an engine it serves with additional_config['tbo'] "
                           "is refused by name", module_name, class_name, e)  # for tbo on it meets runner_kind
            continue
        original = cls.__dict__.get("load_model")
        if original is not None and not getattr(original, _MARK, False):
            cls.load_model = _wrap_load_model(original)
    module_name, class_name, method = DP_ENGINE_SYNC
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        logger.warning("tbo plugin: cannot wrap %s.%s (%s); vLLM's own DP all-reduce keeps its group's timeout",
                       module_name, class_name, e)
        return
    original = cls.__dict__.get(method)
    if original is not None and not getattr(original, _MARK, False):
        setattr(cls, method, _wrap_engine_sync(original))


def _wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = parse_config(self.vllm_config.additional_config)
        if config is None:
            return original(self, *args, **kwargs)
        import vllm
        from vllm.platforms import current_platform

        from tbo.integrations.vllm.admit.checks import check_engine, check_vllm_version
        from tbo.integrations.vllm.admit.runners import check_v2, runner_kind

        kind = runner_kind(self, vllm.__version__)
        if kind == "v2":
            check_vllm_version(vllm.__version__)
            check_v2(type(self), self.vllm_config, config, vllm.__version__)
        architecture = check_engine(self.vllm_config, config, vllm.__version__, current_platform.device_type)
        result = original(self, *args, **kwargs)
        if kind == "v2":
            from tbo.integrations.vllm.runner.v2 import V2Engine

            V2Engine(self, config, architecture)
        else:
            from tbo.integrations.vllm.runner.engine import TboEngine

            TboEngine(self, config, architecture)
        return result

    setattr(load_model, _MARK, True)
    return load_model


def _wrap_engine_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _has_global_unfinished_reqs(self: Any, local_unfinished: bool) -> Any:
        timeout_s = self.__dict__.get("_tbo_sync_timeout_s", 0.0)
        if timeout_s == 0.0:  # once per engine: its tbo config's deadline, or None without tbo
            config = parse_config(self.vllm_config.additional_config)
            timeout_s = self._tbo_sync_timeout_s = None if config is None else config.comm_timeout_s
        if timeout_s is None:
            return original(self, local_unfinished)
        from tbo.integrations.vllm.runner.dp import bounded_engine_sync

        return bounded_engine_sync(self, timeout_s, original, local_unfinished)

    setattr(_has_global_unfinished_reqs, _MARK, True)
    return _has_global_unfinished_reqs
