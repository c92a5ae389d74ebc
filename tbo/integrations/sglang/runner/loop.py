"""The model's layer loop through tbo: what runs in place of the inner model's ``forward`` (``Qwen2MoeModel``'s,
which Qwen3-MoE inherits and whose loop calls SGLang's ``model_forward_stages`` under SGLang's own TBO, and
``MixtralModel``'s, which has no such seam: one seam serves both).

The embedding stays SGLang's (``embed_tokens``), the layers run through `model_forward_maybe_tbo` as
`SglangDecoderLayer` ops with the step's strategy, and the final norm is SGLang's ``residual_batch.final_norm``,
applied per microbatch by the last layer. On a step tbo splits, each microbatch gets its own ForwardBatch (SGLang's
``filter_batch``: `tbo.integrations.sglang.step.batch.children`) with its own residual stream and its own attention
backend planned for it (`MicrobatchAttention`), and its stages run in its own forward context (`MicrobatchContexts`,
the executor's stage hooks); the outputs are merged back in token order.

Choosing the strategy, running, timing, tracing and counting the step are the kit's
(`tbo.integrations.engine.loop.EngineLayerLoop`); this loop adds SGLang's batch per microbatch, its residual stream,
the step-time histogram, the adaptive split's measurement and, under expert parallelism, the rows that crossed
ranks. Diagnostics never fail a step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from tbo.integrations.engine.loop import EngineLayerLoop, LayerRun
from tbo.integrations.engine.stats import StatsFile, StepStats
from tbo.integrations.sglang.runner.attention import MicrobatchAttention
from tbo.integrations.sglang.runner.contexts import MicrobatchContexts
from tbo.integrations.sglang.step.batch import children, decide_batch
from tbo.split import SplitPolicy
from tbo.split.plan import MicrobatchSlice

__all__ = ["LayerLoop"]


class LayerLoop(EngineLayerLoop):
    """Callable in place of the inner model's ``forward`` (same arguments, same result)."""

    logger = logging.getLogger("sglang.tbo")

    def __init__(self, inner: Any, layers: list[Any], strategies: dict[str, Any], backend: Any,
                 policy: SplitPolicy, *, adaptive: Any = None, stats: StepStats | None = None,
                 stats_file: StatsFile | None = None, op_times: bool = False, reducer: Any = None) -> None:
        super().__init__(layers, strategies, backend, stats=stats, stats_file=stats_file, op_times=op_times)
        self.inner = inner
        #: what a failed step drains before it raises: the expert backend and the TP reducer (transfers in flight)
        self.drain = tuple(x for x in (backend, reducer) if x is not None)
        self.policy, self.adaptive = policy, adaptive
        #: each microbatch's own attention backend, set once the runner made its own (`SglangEngine.bind_attention`);
        #: a split step before that is an error, never a step attending on the whole batch's plan
        self.attention: MicrobatchAttention | None = None
        #: SGLang's own forward of the inner model, for the unsplit steps it computes exactly as tbo's layers would
        #: (set by the engine: `tbo.integrations.sglang.runner.engine.sglang_runs_unsplit`); None: tbo's layers run
        #: every step
        self.own_forward: Any = None
        self.own_steps = 0  #: unsplit steps SGLang's own forward ran
        #: the expert-parallel backend whose ``remote_rows`` and ``count_exchanges`` the steps count (set by the
        #: engine under expert parallelism); None: no rows cross ranks
        self.traffic: Any = None
        self._step_traffic = (0, 0)
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
        from sglang.srt.utils.common import BumpAllocator

        self._residual = residual_batch
        #: SGLang's ``BumpAllocator`` where a layer's attention takes one (DeepSeek's MLA), else None
        self.allocator = BumpAllocator if any(layer.structure.attn_takes_allocator for layer in layers) else None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
                 input_embeds: torch.Tensor | None = None, pp_proxy_tensors: Any = None, **kwargs: Any) -> Any:
        step = decide_batch(self.policy if self.adaptive is None else self.adaptive.policy, forward_batch)
        if step is not None and self.adaptive is not None:  # the measured choice's, planned again for its count
            step = self.adaptive.decide(step, lambda policy: decide_batch(policy, forward_batch))
        plan = step.plan if step is not None else None
        if plan is None and self.own_forward is not None and not (self.live_trace is not None and
                                                                  self.live_trace.armed):
            return self._own(step, input_ids, positions, forward_batch, input_embeds=input_embeds,
                             pp_proxy_tensors=pp_proxy_tensors, **kwargs)
        hidden = self.inner.embed_tokens(input_ids) if input_embeds is None else input_embeds
        if plan is None:
            batches, hooks = [forward_batch], None
            self._residual.start(forward_batch)
        else:
            if hidden.shape[0] != plan.num_tokens:
                raise RuntimeError(f"tbo planned {plan.num_tokens} tokens but the model got {hidden.shape[0]}")
            batches = children(forward_batch, plan)
            for child in batches:
                self._residual.start(child)
            if self.attention is None:
                raise RuntimeError("tbo split a step before SGLang's runner made its attention backend: no "
                                   "microbatch has a backend of its own to attend on")
            hooks = MicrobatchContexts(batches, self.attention.plan(batches))

        def pinned(mb: MicrobatchSlice | None) -> dict[str, Any]:
            fb = batches[0 if mb is None else mb.microbatch_idx]
            out = {"positions": positions if mb is None else fb.positions, "forward_batch": fb}
            if self.allocator is not None:  # MLA's scratch zeros, two a layer, one allocator a microbatch
                out["zero_allocator"] = self.allocator(buffer_size=2 * len(self.layers), dtype=torch.float32,
                                                       device=hidden.device)
            return out

        before = self._traffic()
        run = self.run(step, hidden, pinned=pinned, counted=step is not None, stage_hooks=hooks, drain=self.drain)
        if step is not None:
            self._step_traffic = tuple(a - b for a, b in zip(self._traffic(), before))
            self.count(run)
        return run.out["hidden_states"]

    def _own(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        """An unsplit step through SGLang's own forward (what it costs without tbo, plus the decision), counted as
        tbo's would be; an armed live trace runs tbo's layers instead, so that the step is on the trace."""
        t0 = time.perf_counter()
        out = self.own_forward(*args, **kwargs)
        if step is not None:
            self.own_steps += 1
            self.count(LayerRun({}, step, str(step.slot), time.perf_counter() - t0, None, None))
        return out

    def _traffic(self) -> tuple[int, int]:
        """The expert-parallel backend's ``remote_rows`` and ``count_exchanges`` so far (zero without one)."""
        return getattr(self.traffic, "remote_rows", 0), getattr(self.traffic, "count_exchanges", 0)

    def count_more(self, run: LayerRun) -> None:
        rows, exchanges = self._step_traffic
        self._step_traffic = (0, 0)
        self.stats.remote_rows += rows
        self.stats.count_exchanges += exchanges
        # the step-time histogram: the layer loop's wall time (SGLang offers tbo no later seat it waits at; on a GPU
        # kernels the loop launched may still run, as in the adaptive split's measurement)
        self.stats.observe_step(run.step.kind, run.microbatches > 1, run.seconds)
        if self.adaptive is not None:
            self.adaptive.step_done()
