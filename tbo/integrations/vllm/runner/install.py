"""The runner's methods a `TboEngine` wraps, each on the instance and each with its undo (`install_on_runner`).

``execute_model`` runs inside the engine's scoped `RunnerPatches`; ``initialize_metadata_builders`` makes one
attention metadata builder per microbatch (the drafter's too); ``sample_tokens`` ends an adaptive step's clock;
``shutdown`` takes tbo off first and then always runs vLLM's own; with vLLM's forward for unsplit steps, the
patches tell `StepForwards` each decided step (and a compiled engine's warm-up compiles tbo's ops too); otherwise the
inner model's ``forward`` is the layer loop; with a FULL ``cudagraph_mode`` a capture of a size tbo splits runs with
the size's plan. Finally ``runner.tbo`` is the engine.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from tbo.integrations.engine.undo import UndoStack
from tbo.integrations.vllm.runner.patches import check_metadata_builders, timed_sample

__all__ = ["install_on_runner", "install_step_and_shutdown"]

logger = logging.getLogger("vllm.tbo")


def install_on_runner(engine: Any, undo: UndoStack) -> None:
    """Wrap ``engine.runner``'s methods for ``engine`` (a `TboEngine`, built up to its layer loop, forwards and
    draft pass), registering each wrapper's undo on ``undo``."""
    runner, patches = engine.runner, engine.patches
    sample = runner.sample_tokens
    init_builders = runner.initialize_metadata_builders

    @functools.wraps(init_builders)
    def initialize_metadata_builders(*args: Any, **kwargs: Any) -> Any:
        with patches.microbatching():  # one attention metadata builder per microbatch
            result = init_builders(*args, **kwargs)
        check_metadata_builders(runner.attn_groups, patches.policy.num_microbatches)
        if engine.draft is not None:  # the drafter's attention groups: a builder per microbatch too
            engine.draft.make_builders(patches.policy.num_microbatches)
        return result

    sample_tokens = timed_sample(engine, sample)

    _install_forward(engine, undo)
    install_step_and_shutdown(engine, undo)
    undo.set_attr(runner, "sample_tokens", sample_tokens)  # ends the step's clocks (the histogram's, adaptive's)
    undo.set_attr(runner, "initialize_metadata_builders", initialize_metadata_builders)
    if engine.graphs is not None:  # vLLM's capture of a size tbo splits runs with the size's plan
        undo.set_attr(runner, "_warmup_and_capture", engine.graphs.wrap(runner._warmup_and_capture, patches))
    undo.set_attr(runner, "tbo", engine)


def install_step_and_shutdown(engine: Any, undo: UndoStack) -> None:
    """What every runner kind wraps alike: ``execute_model`` inside the engine's scoped patches, and ``shutdown``
    taking tbo off first and then always running vLLM's own."""
    runner, patches = engine.runner, engine.patches
    execute, shutdown = runner.execute_model, runner.shutdown

    @functools.wraps(execute)
    def execute_model(*args: Any, **kwargs: Any) -> Any:
        with patches.scope():
            return execute(*args, **kwargs)

    @functools.wraps(shutdown)
    def shutdown_(*args: Any, **kwargs: Any) -> Any:
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - taking tbo off must not keep vLLM from releasing the engine
            logger.exception("tbo: taking tbo off the runner failed; vLLM's own shutdown goes on")
        return shutdown(*args, **kwargs)

    undo.set_attr(runner, "execute_model", execute_model)
    undo.set_attr(runner, "shutdown", shutdown_)


def _install_forward(engine: Any, undo: UndoStack) -> None:
    """The inner model's forward: the layer loop for every step, or (`StepForwards`) chosen per step, a compiled
    engine's warm-up then compiling tbo's ops as well (`StepForwards.warming_up`)."""
    runner, forwards = engine.runner, engine.forwards
    if forwards is None:
        undo.set_attr(engine._model, "forward", engine.loop)
        return
    undo.set_attr(engine.decider, "on_step", forwards.on_step)
    if not engine.compute.compiled:
        return
    dummy_run = runner._dummy_run

    @functools.wraps(dummy_run)
    def _dummy_run(*args: Any, **kwargs: Any) -> Any:
        if engine.compute.warm:
            return dummy_run(*args, **kwargs)
        with forwards.warming_up():
            return dummy_run(*args, **kwargs)

    undo.set_attr(runner, "_dummy_run", _dummy_run)
