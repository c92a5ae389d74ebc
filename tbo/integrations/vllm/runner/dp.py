"""Data parallelism wired into one runner: its real and dummy steps agree with the other DP ranks
(`tbo.integrations.vllm.step.agree.StepAgreementHook`), and vLLM's engine-loop all-reduce waits under tbo's deadline
(`bounded_engine_sync`). What the plugin accepts is `tbo.integrations.vllm.admit.parallel`'s; the agreement itself and
why it is one collective per step are in `tbo.integrations.vllm.step.agree`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator

from tbo.integrations.engine.undo import UndoStack
from tbo.integrations.vllm.comm.bounded import call_bounded
from tbo.integrations.vllm.step.agree import StepAgreementHook, agreement_config
from tbo.split.kinds import StepKind

__all__ = ["bounded_engine_sync", "install_data_parallel"]


def bounded_engine_sync(core: Any, timeout_s: float, call: Any, local_unfinished: bool) -> Any:
    """``call(core, local_unfinished)``: vLLM's engine-loop DP all-reduce (``_has_global_unfinished_reqs`` of the
    engine core ``core``), which ends the ranks' wave of steps when no rank has unfinished requests.

    * It waits at most ``timeout_s``: a peer that stalls or dies between two of its steps leaves this rank's engine
      core waiting there, not in tbo's agreement (its worker has no step to run); gloo's own default is 30 minutes.
    * Requests waiting in the engine core's input queue count as unfinished. vLLM asks its scheduler only, which
      has not seen them yet: requests that reached the queue during the step (a front end adds a round's requests
      one by one while the engine already steps the first) would otherwise let every rank end the wave, and offline
      (no DP coordinator) this rank's engine would then start a wave of its own that no idle peer joins.
    * From vLLM 0.33 the all-reduce is point-to-point (``cpu_all_reduce_``: gloo sends and receives). Their waits
      ignore the group's timeout, which `call_bounded` shortens, and take the engine's
      ``parallel_config.cpu_distributed_timeout_seconds`` (None: no bound of their own). For the call, that setting
      is tbo's deadline where it is unset or longer (`_p2p_deadline`); the engine's own value comes back after.
    """
    pending = bool(getattr(core, "input_queue", None) is not None and not core.input_queue.empty())
    with _p2p_deadline(core, timeout_s):
        return call_bounded(core.dp_group, timeout_s,
                            "vLLM's engine-loop DP all-reduce (_has_global_unfinished_reqs)",
                            call, core, local_unfinished or pending, label=f"rank {core.dp_rank}")


@contextmanager
def _p2p_deadline(core: Any, timeout_s: float) -> Iterator[None]:
    """While it lasts, ``core``'s ``parallel_config.cpu_distributed_timeout_seconds`` (vLLM 0.33 and later; an
    ``int | None`` of whole seconds, read on every DP sync) is at most ``timeout_s`` rounded up; a vLLM without the
    setting (0.32) is left as it is."""
    config = getattr(getattr(core, "vllm_config", None), "parallel_config", None)
    if config is None or not hasattr(config, "cpu_distributed_timeout_seconds"):
        yield
        return
    previous = config.cpu_distributed_timeout_seconds
    bound = max(1, math.ceil(timeout_s))
    if previous is not None and previous <= bound:
        yield
        return
    config.cpu_distributed_timeout_seconds = bound
    try:
        yield
    finally:
        config.cpu_distributed_timeout_seconds = previous


def install_data_parallel(engine: Any, undo: UndoStack) -> None:
    """Make ``engine`` (a `TboEngine` on a DP+EP runner) agree on every step with the other DP ranks: the real
    steps (its ``execute_model``) and the dummy ones (``_dummy_run``: profiling, warm-up, and an idle rank's steps
    while its peers work), and count ``ep_size`` and ``remote_rows`` in its stats. Each change registers its undo on
    ``undo`` (the runner's methods go back to what they were: the engine's own wrappers)."""
    import functools

    from vllm.config import CUDAGraphMode
    from vllm.distributed import get_dp_group

    runner, patches, loop = engine.runner, engine.patches, engine.loop
    agree = StepAgreementHook(engine.config.num_microbatches, get_dp_group().cpu_group, engine.config.comm_timeout_s,
                              agreement_config(engine), adaptive=engine.adaptive,
                              merges_coordination=runner.compilation_config.cudagraph_mode == CUDAGraphMode.NONE,
                              stats=(engine.stats,))
    undo.set_attr(engine.decider, "agree", agree)  # every step's decision first settled with the other DP ranks
    engine.stats.ep_size = engine.ep_size
    undo.set_attr(loop, "traffic", engine.backend if hasattr(engine.backend, "remote_rows")
                  else getattr(engine.backend, "inner", None))
    execute, dummy_run = runner.execute_model, runner._dummy_run
    serving = [False]  # dummy runs before the first real step are profiling and warm-up: not counted

    @functools.wraps(execute)
    def execute_model(*args: Any, **kwargs: Any) -> Any:
        serving[0] = True
        return execute(*args, **kwargs)

    @functools.wraps(dummy_run)
    def _dummy_run(*args: Any, **kwargs: Any) -> Any:
        with patches.dummy_scope(StepKind.IDLE if serving[0] else StepKind.WARMUP):
            return dummy_run(*args, **kwargs)

    undo.set_attr(runner, "execute_model", execute_model)
    undo.set_attr(runner, "_dummy_run", _dummy_run)
