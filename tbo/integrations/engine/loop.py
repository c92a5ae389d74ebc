"""The part of a model's layer loop that every engine shares: one step's layers through tbo, timed and counted.

Why it exists: vLLM's loop, SGLang's loop and the small engine in ``examples/tiny_engine.py`` each chose the step's
strategy (the adaptive split's candidate, else the slot's own), ran the layers through `model_forward_maybe_tbo`, timed
the ops (``op_times``), recorded the live trace a request armed, counted the step and wrote the ``stats_file``: the
same forty lines three times, and a third engine would have written them a fourth. Here they are once; an engine's
loop supplies only what its engine decides:

* the step (`tbo.integrations.engine.step.Step`, decided from its batch) and the hidden states its model's start made;
* what each microbatch's ops read beside the hidden states (``pinned``: positions, the engine's batch per microbatch);
* its forward context per microbatch (``stage_hooks``, entered around each microbatch's stages);
* anything more it counts (`EngineLayerLoop.count_more`), and its model's end (the final norm), after `run`.

The loop never fails a step for a diagnostic: a ``stats_file`` that cannot be written is logged, once per distinct
error, and counted (`tbo.integrations.engine.stats.StatsFile.write_or_log`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Sequence

from tbo.core.observer import as_observer
from tbo.integrations.engine.stats import StatsFile, StepStats
from tbo.integrations.engine.step import Step
from tbo.runtime.forward import model_forward_maybe_tbo
from tbo.runtime.op_times import OpTimes
from tbo.split.kinds import Slot, StepKind
from tbo.split.plan import MicrobatchSlice

__all__ = ["EngineLayerLoop", "LayerRun"]


@dataclass(frozen=True)
class LayerRun:
    """What one step's layers did, for its counting."""

    #: the executor's outputs (the hidden states, and what else the ops returned: ``residual`` in vLLM)
    out: dict[str, Any]
    step: Step | None
    #: the name counted for a split step: the adaptive split's candidate, else the strategy's own (or the slot)
    strategy: str
    #: the layers' wall time (the loop's: on a GPU, kernels it launched may still run)
    seconds: float
    timer: OpTimes | None
    recorder: Any

    @property
    def microbatches(self) -> int:
        """How many microbatches the step ran in (1: unsplit)."""
        plan = None if self.step is None else self.step.plan
        return 1 if plan is None else plan.num_microbatches


class EngineLayerLoop:
    """One step's layers, strategy chosen, timed, traced and counted; an engine's ``LayerLoop`` subclasses it and
    calls `run` then `count` from the model ``forward`` it replaces."""

    #: where a ``stats_file`` that cannot be written is logged (an engine's loop names its engine's logger)
    logger = logging.getLogger("tbo.engine")

    def __init__(self, layers: Sequence[Any], strategies: Mapping[str, Any], backend: Any, *,
                 stats: StepStats | None = None, stats_file: StatsFile | None = None, op_times: bool = False) -> None:
        #: the layer adapters the strategies' ops were bound to, and the bound strategies by slot and by name
        self.layers, self.strategies, self.backend = layers, strategies, backend
        self.stats = StepStats() if stats is None else stats
        self.stats_file = stats_file  #: ``stats_file``, written after each counted step
        self.op_times = op_times  #: ``op_times``: time every op of the counted steps
        #: the live trace a request arms (`tbo.integrations.engine.live_trace`; set with the metrics publisher): a
        #: step reads its ``armed`` flag and nothing else while nobody traces
        self.live_trace: Any = None

    def strategy_of(self, step: Step | None) -> tuple[Any, str]:
        """The bound strategy a step runs, and the name a split step is counted under: the adaptive split's candidate
        where it chose one (bound at the engine's start), else the slot's own strategy's name (or the slot). Steps tbo
        did not decide (profiling, warm-up) run prefill's."""
        slot = step.slot if step is not None else Slot.PREFILL
        name = step.strategy_name if step is not None and step.plan is not None else None
        strategy = self.strategies[name or slot]
        return strategy, name or strategy.name or str(slot)

    def run(self, step: Step | None, hidden: Any, *, pinned: Callable[[MicrobatchSlice | None], dict[str, Any]],
            counted: bool, stage_hooks: Any = None, backend: Any = None, drain: Sequence[Any] | None = None,
            output_key: str | Sequence[str] = "hidden_states",
            guard: ContextManager[Any] | None = None) -> LayerRun:
        """Run the step's layers (split by ``step.plan``, or whole) and say what ran. ``counted``: time its ops when
        ``op_times`` is on, and record it where a live trace is armed. ``backend``: the expert backend this step uses
        (default: the loop's); ``drain``: what a failed step drains before it raises (default: that backend);
        ``guard``: a context the executor runs inside (vLLM: no host reads on a split decode step)."""
        strategy, name = self.strategy_of(step)
        plan = None if step is None else step.plan
        timer = OpTimes() if self.op_times and counted else None
        live = self.live_trace
        recorder = live.recorder() if live is not None and live.armed and counted else None
        extra = {} if drain is None else {"drain": tuple(drain)}
        t0 = time.perf_counter()
        with guard if guard is not None else contextlib.nullcontext():
            out = model_forward_maybe_tbo(self.layers, {"hidden_states": hidden}, strategy, plan, pinned=pinned,
                                          output_key=output_key,
                                          backend=self.backend if backend is None else backend,
                                          observer=as_observer([timer, recorder]), stage_hooks=stage_hooks, **extra)
        return LayerRun(out, step, name, time.perf_counter() - t0, timer, recorder)

    def count(self, run: LayerRun) -> None:
        """Count a step that ran (`run`): its kind, tokens, microbatches, cut request and unsplit reason; its strategy
        where split; its op times; its live trace; then `count_more` (the engine's), then the ``stats_file``."""
        step, s = run.step, self.stats
        if step is None:
            raise ValueError("a step tbo did not decide (profiling, warm-up) is not counted: count only decided steps")
        plan = step.plan
        # a dummy step (DP idle) carries no tokens of its own
        s.record(step.kind, 0 if step.kind == StepKind.IDLE else step.num_tokens, run.microbatches,
                 plan is not None and plan.two_chunk, step.counted_reason)
        if run.microbatches > 1:
            s.record_strategy(run.strategy)
        if run.timer is not None:
            s.add_op_times(run.timer.seconds, run.timer.calls, run.seconds)
        if run.recorder is not None:
            tokens = [step.num_tokens] if plan is None else [m.tokens_unpadded_len for m in plan.microbatches]
            self.live_trace.record(run.recorder, f"{step.kind} step, {'split' if plan else 'unsplit'}", tokens)
        self.count_more(run)
        self.write_stats()

    def count_more(self, run: LayerRun) -> None:
        """What an engine counts beyond the kit's (vLLM: rows sent to peers, verified drafts; SGLang: the step-time
        histogram and the adaptive split's measurement). Nothing by default."""

    def write_stats(self) -> None:
        """Write ``stats_file`` (if set): a diagnostic, logged and counted where it fails, never raised."""
        if self.stats_file is not None:
            self.stats_file.write_or_log(self.stats, self.logger)

    @property
    def stats_file_failures(self) -> int:
        """``stats_file`` writes that failed."""
        return 0 if self.stats_file is None else self.stats_file.failures
