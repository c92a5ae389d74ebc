"""The model's layer loop through tbo: what runs in place of the inner model's ``forward`` (``Qwen2MoeModel``'s,
which Qwen3-MoE inherits and whose loop calls SGLang's ``model_forward_stages`` under SGLang's own TBO, and
``MixtralModel``'s, which has no such seam: one seam serves both).

The embedding stays SGLang's (``embed_tokens``), the layers run through `model_forward_maybe_tbo` as
`SglangDecoderLayer` ops with the step's strategy, and the final norm is SGLang's ``residual_batch.final_norm``,
applied per microbatch by the last layer. On a step tbo splits, each microbatch gets its own ForwardBatch (SGLang's
``filter_batch``: `tbo.integrations.sglang.step.batch.children`) with its own residual stream, and its stages run in
its own forward context (`MicrobatchContexts`, the executor's stage hooks); the outputs are merged back in token
order.

Diagnostics never fail a step: a ``stats_file`` that cannot be written is logged once per distinct error.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from tbo.core.observer import as_observer
from tbo.integrations.engine.stats import StatsFile, StepStats
from tbo.integrations.sglang.runner.contexts import MicrobatchContexts
from tbo.integrations.sglang.step.batch import children, decide_batch
from tbo.runtime.forward import model_forward_maybe_tbo
from tbo.runtime.op_times import OpTimes
from tbo.split import SplitPolicy
from tbo.split.kinds import Slot
from tbo.split.plan import MicrobatchSlice

__all__ = ["LayerLoop"]

logger = logging.getLogger("sglang.tbo")


class LayerLoop:
    """Callable in place of the inner model's ``forward`` (same arguments, same result)."""

    def __init__(self, inner: Any, layers: list[Any], strategies: dict[str, Any], backend: Any,
                 policy: SplitPolicy, *, adaptive: Any = None, stats: StepStats | None = None,
                 stats_file: StatsFile | None = None, op_times: bool = False, reducer: Any = None) -> None:
        self.inner, self.layers, self.strategies, self.backend = inner, layers, strategies, backend
        #: what a failed step drains before it raises: the expert backend and the TP reducer (transfers in flight)
        self.drain = tuple(x for x in (backend, reducer) if x is not None)
        self.policy, self.adaptive = policy, adaptive
        self.stats = StepStats() if stats is None else stats
        self.stats_file, self.op_times = stats_file, op_times
        #: the live trace a request arms (`tbo.integrations.engine.live_trace`; set with the metrics publisher): a
        #: step reads its ``armed`` flag, and records only while it is set
        self.live_trace: Any = None
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

        self._residual = residual_batch

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
                 input_embeds: torch.Tensor | None = None, pp_proxy_tensors: Any = None, **kwargs: Any) -> Any:
        hidden = self.inner.embed_tokens(input_ids) if input_embeds is None else input_embeds
        step = decide_batch(self.policy if self.adaptive is None else self.adaptive.policy, forward_batch)
        if step is not None and self.adaptive is not None:  # the measured choice's, planned again for its count
            step = self.adaptive.decide(step, lambda policy: decide_batch(policy, forward_batch))
        plan = step.plan if step is not None else None
        if plan is None:
            batches, hooks = [forward_batch], None
            self._residual.start(forward_batch)
        else:
            if hidden.shape[0] != plan.num_tokens:
                raise RuntimeError(f"tbo planned {plan.num_tokens} tokens but the model got {hidden.shape[0]}")
            batches = children(forward_batch, plan)
            for child in batches:
                self._residual.start(child)
            hooks = MicrobatchContexts(batches)

        def pinned(mb: MicrobatchSlice | None) -> dict[str, Any]:
            fb = batches[0 if mb is None else mb.microbatch_idx]
            return {"positions": positions if mb is None else fb.positions, "forward_batch": fb}

        timer = OpTimes() if self.op_times and step is not None else None
        live = self.live_trace
        recorder = live.recorder() if live is not None and live.armed and step is not None else None
        slot = step.slot if step is not None else Slot.PREFILL
        # the adaptive split's candidate where it chose one (bound at the engine's start), else the slot's own
        name = step.strategy_name if step is not None and plan is not None else None
        t0 = time.perf_counter()
        strategy = self.strategies[name or slot]
        out = model_forward_maybe_tbo(self.layers, {"hidden_states": hidden}, strategy, plan,
                                      pinned=pinned, backend=self.backend, drain=self.drain,
                                      observer=as_observer([timer, recorder]), stage_hooks=hooks)
        if step is not None:
            if plan is not None:
                self.stats.record_strategy(name or strategy.name or slot)
            self._count(step, plan, timer, time.perf_counter() - t0)
            if recorder is not None:
                tokens = [step.num_tokens] if plan is None else [m.tokens_unpadded_len for m in plan.microbatches]
                live.record(recorder, f"{step.kind} step, {'split' if plan else 'unsplit'}", tokens)
        return out["hidden_states"]

    def _count(self, step: Any, plan: Any, timer: OpTimes | None, layers_s: float) -> None:
        self.stats.record(step.kind, step.num_tokens, 1 if plan is None else plan.num_microbatches,
                          plan is not None and plan.two_chunk, step.counted_reason)
        # the step-time histogram: the layer loop's wall time (SGLang offers tbo no later seat it waits at; on a GPU
        # kernels the loop launched may still run, as in the adaptive split's measurement)
        self.stats.observe_step(step.kind, plan is not None, layers_s)
        if timer is not None:
            self.stats.add_op_times(timer.seconds, timer.calls, layers_s)
        if self.adaptive is not None:
            self.adaptive.step_done()
        self.write_stats()

    def write_stats(self) -> None:
        """Write ``stats_file`` (if set): a diagnostic, logged and counted where it fails, never raised
        (`tbo.integrations.engine.stats.StatsFile.write_or_log`)."""
        if self.stats_file is not None:
            self.stats_file.write_or_log(self.stats, logger)
