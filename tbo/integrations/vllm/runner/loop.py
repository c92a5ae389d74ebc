"""The model's layer loop through tbo: what runs in place of ``Qwen3MoeModel.forward`` / ``DeepseekV2Model.forward``.

Embeddings, the final norm and everything outside the layers stay vLLM's; the layers run through
`model_forward_maybe_tbo` as `VllmDecoderLayer` ops with the step's strategy. On a step the runner built in
microbatches, the plan decided for it splits the hidden states, each microbatch gets its positions (pinned in its
State) and its own forward context (`ContextSwitcher`, the executor's stage hooks: no observer on the hot path),
and the outputs are merged back in token order.

A split decode step runs inside `tbo.comm.devices.no_host_reads`: tbo's routes, checks and statistics take their
fixed-shape forms there (docs/vllm.md, "Compiled mode and host reads").

Choosing the strategy, running, timing, tracing and counting the step are the kit's
(`tbo.integrations.engine.loop.EngineLayerLoop`); this loop adds vLLM's ends around the layers, its forward contexts,
data parallelism's agreed rows and idle steps, the step clock and what vLLM counts beyond the kit (rows sent to peers,
verified drafts). Diagnostics never fail a step: a ``stats_file`` that cannot be written (a directory, a full disk, a
missing folder) is logged, once per distinct error, and the step's result is returned as if it had been written.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from tbo.comm.devices import no_host_reads
from tbo.integrations.engine.loop import EngineLayerLoop, LayerRun
from tbo.integrations.engine.stats import StatsFile, StepClock, StepStats
from tbo.integrations.vllm.comm.backend import select_backend
from tbo.integrations.vllm.model.compute import EAGER, Compute
from tbo.integrations.vllm.model.structure import model_ends
from tbo.integrations.vllm.runner.contexts import ContextSwitcher, microbatch_contexts
from tbo.integrations.vllm.step.decider import StepDecider
from tbo.split.kinds import Slot, StepKind
from tbo.split.plan import MicrobatchSlice

__all__ = ["LayerLoop"]


def _split_decode(step: Any) -> bool:
    """A split step run by the decode strategy: tbo's ops run it with fixed shapes, reading nothing on the host
    (`tbo.comm.devices.no_host_reads`; with data parallelism the agreed rows are the static bounds). Decided by the
    agreed strategy, never by this rank's own batch alone: every rank's dispatches must take the same form (the
    fixed-shape combine's sizes differ from the counted one's)."""
    return step is not None and step.plan is not None and step.slot == Slot.DECODE


class LayerLoop(EngineLayerLoop):
    """Callable in place of the inner model's ``forward`` (same arguments, same result)."""

    logger = logging.getLogger("vllm.tbo")

    def __init__(self, model: Any, layers: list[Any], strategies: dict[str, Any], backend: Any,
                 decider: StepDecider, vllm_config: Any, *, stats: StepStats | None = None,
                 stats_file: StatsFile | None = None, op_times: bool = False, agreed_rows: bool = True) -> None:
        super().__init__(layers, strategies, backend, stats=stats, stats_file=stats_file, op_times=op_times)
        self.model = model
        #: the engine's step decisions: the step being run is its `StepDecider.step`
        self.decider, self.vllm_config = decider, vllm_config
        #: the model's own start and end around the layers (its embedding, its final norm; Granite's multipliers)
        self.ends = model_ends(model, layers)
        #: the functions the final norm runs through, as the layers' ops do (`tbo.integrations.vllm.model.compute`): the
        #: modules as they are, or a compiled engine's compiled functions (set by the engine)
        self.compute: Compute = EAGER
        #: each counted step's time for ``stats()``' histogram: started here, stopped where the runner's
        #: ``sample_tokens`` returns (`tbo.integrations.vllm.runner.patches.timed_sample`)
        self.clock = StepClock(self.stats)
        self.traffic: Any = None  #: data parallel: the backend counting ``remote_rows`` (set by `tbo.integrations.vllm.runner.dp`)
        #: ``agreed_rows``: data parallel dispatches send by the step's agreed rows
        self.agreed_rows = agreed_rows
        #: a split step's microbatch forward contexts, given its plan: None reads them from the step's own context,
        #: as V1's runner builds it (`microbatch_contexts`); Model Runner V2's are the ones tbo's microbatch runner
        #: prepared (`tbo.integrations.vllm.runner.v2.TboUBatchRunner.microbatch_contexts`)
        self.contexts_for: Callable[[Any], list[Any]] | None = None
        self._traffic_before = (0, 0)

    def __call__(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                 intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        hidden = self.ends.start(input_ids, inputs_embeds)
        step = self.decider.step  # None in profiling and warm-up runs: they run unsplit, uncounted
        dp = step.dp if step is not None else None  # data parallel: what the ranks agreed (`tbo.integrations.vllm.step.agree`)
        if dp is not None and dp.all_idle:  # every DP rank idle: nobody needs a dispatch
            return self._skip_idle(hidden)
        plan = step.plan if step is not None else None
        hooks = None
        if plan is not None:
            if hidden.shape[0] != plan.num_tokens:
                raise RuntimeError(f"tbo planned {plan.num_tokens} tokens but the model got {hidden.shape[0]}")
            if dp is None or not dp.empty_tail:  # empty tail: microbatch 0 is the whole step, in the step's own context
                contexts = (microbatch_contexts(get_forward_context(), plan, self.vllm_config)
                            if self.contexts_for is None else self.contexts_for(plan))
                hooks = ContextSwitcher(contexts)
        counted = step is not None and step.kind != StepKind.WARMUP

        def pinned(mb: MicrobatchSlice | None) -> dict[str, Any]:
            values = {"positions": positions if mb is None else positions[mb.tokens_start:mb.tokens_end]}
            if self.agreed_rows and dp is not None and dp.rows is not None:  # data parallel: agreed rows
                values["rows_per_rank"] = dp.rows[0 if mb is None else mb.microbatch_idx]
            return values

        if counted and step.kind.samples:  # a dummy step samples nothing; a draft is not a step
            self.clock.start(step.kind, plan is not None)
        self._traffic_before = self._traffic()
        slot = step.slot if step is not None else Slot.PREFILL
        # tbo's part of a split decode step reads nothing on the host; DeepEP: the slot's backend
        run = self.run(step, hidden, pinned=pinned, counted=counted, stage_hooks=hooks,
                       backend=select_backend(self.backend, slot), output_key=self.ends.outputs,
                       guard=no_host_reads(_split_decode(step)))
        hidden = self.ends.end(run.out, self.compute)
        if counted:
            self.count(run)
        return hidden

    def count_more(self, run: LayerRun) -> None:
        step, s = run.step, self.stats
        rows, exchanges = (a - b for a, b in zip(self._traffic(), self._traffic_before))
        s.remote_rows += rows
        s.count_exchanges += exchanges
        s.peer_strategy_steps += int(step.kind != StepKind.IDLE and step.slot != step.own_slot)
        if step.draft_tokens:
            s.record_verify(step.draft_tokens, run.microbatches > 1, step.varying_drafts)

    def _skip_idle(self, hidden: torch.Tensor) -> torch.Tensor:
        """A dummy step every DP rank runs at once (vLLM's steps between a wave's last request and its engine-loop
        sync, up to ``dp_sync_interval - 1`` of them): counted, its layer stack skipped. It exists only for the
        collectives of peers' batches, and every peer is idle too (the agreement says so on every rank alike);
        vLLM discards what a dummy step returns."""
        self.stats.record(StepKind.IDLE, 0, 1, False, "idle")
        self.stats.idle_skipped += 1
        self.write_stats()
        return hidden

    def _traffic(self) -> tuple[int, int]:
        """The data-parallel backend's ``remote_rows`` and ``count_exchanges`` so far (zero where it counts none)."""
        return getattr(self.traffic, "remote_rows", 0), getattr(self.traffic, "count_exchanges", 0)
