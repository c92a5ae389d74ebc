"""CUDA graphs of split decode steps in vLLM, written to the contract of vLLM's own DBO graphs (issue 37, item 3).

On a GPU an eager decode step is launch-bound, and an eager split step launches every op twice: TBO only pays once
the step is one graph launch. vLLM's DBO captures FULL CUDA graphs of its microbatched decode steps, one per
uniform-decode token count, the split fixed for that count (``UBatchWrapper``), and runs a step eagerly when its
split is not the graph's (its microbatching aborted at a size whose graph is microbatched). tbo does the same for
its own split, inside vLLM's own machinery, adding no wrapper of its own:

* **Capture.** vLLM captures a FULL graph per batch descriptor (``GPUModelRunner._warmup_and_capture``: warm-up
  runs, then ``_dummy_run`` under its ``CUDAGraphWrapper``). For a descriptor whose dummy batch is a decode batch
  (one token per request: ``num_reqs == num_tokens``, no LoRA) and which tbo's policy splits, `SplitGraphs.wrap`
  runs that call with the step fixed to the size's plan (`graph_plan`): vLLM's runner then builds the dummy step in
  tbo's microbatches (per-microbatch attention metadata from its persistent builders, one per microbatch), the inner
  model runs tbo's `LayerLoop` (inside `tbo.comm.devices.no_host_reads`), and vLLM's ``CUDAGraphWrapper`` records
  that, tbo's split step, under the descriptor. The warm-ups before it run the same split step eagerly.
* **The graph key** is the descriptor (padded token count, padded request count, uniform flag, LoRA) with the
  plan fixed for it (`GraphKey`: the microbatches' token ranges). A descriptor maps to one plan, so vLLM's own
  descriptor-keyed cache holds each split graph once.
* **Replay.** A step vLLM dispatches to a FULL descriptor tbo captured split (`SplitGraphs.settle`): when its own
  decision (tbo's policy on the step's real, unpadded tokens; vLLM's prefix-cache veto) splits it as a decode step
  and every microbatch of the size's plan holds a real token, the step takes the size's plan (its padding in the
  last microbatch, as vLLM's padded ubatch slices have it) and vLLM replays the graph: no Python of tbo's runs.
  tbo counts the step (`graph_replays`) when it decides it, since nothing of its own runs after.
* **A step whose split differs from its graph's runs eager** (`graph_eager_steps`): unsplit by the policy, vetoed,
  a mixed step, or a split whose last microbatch would be all padding. tbo then asks vLLM's own decision again
  with ``force_eager`` (vLLM's NONE mode, unpadded) and the step runs as any eager step does, split by its own plan
  or not. Replaying the split graph instead would read per-microbatch metadata the runner never built for it.
* **Everything else is vLLM's**: descriptors tbo does not split (below the decode threshold, not decode-shaped)
  get vLLM's own unsplit graphs, PIECEWISE dispatches its piecewise graphs (a padded step is never split), and
  steps above the largest capture size run eager, split as the policy says.

Supported ``cudagraph_mode``: FULL, FULL_DECODE_ONLY and FULL_AND_PIECEWISE (`check_cudagraph_mode`). PIECEWISE
alone is refused: it pads every step up to a capture size, which tbo never splits, and its graphs are pieces of
the compiled forward, which tbo's split step does not run. Also refused with a FULL mode: data parallelism (each
step's padded size would have to be agreed across ranks first), ``split: "adaptive"`` (it chooses per step; a
graph fixes the split per size), and a decode backend that reads the host (`check_graph_backend`). Written against vLLM 0.32 and CUDA's semantics; no GPU ran it here (docs/vllm.md).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable

from tbo.integrations.engine.step import Step
from tbo.split import ForwardMode, SplitPlan, SplitPolicy
from tbo.split.kinds import StepKind

__all__ = ["GraphKey", "SplitGraphs", "graph_key", "graph_plan", "mode_name", "settle"]

logger = logging.getLogger("vllm.tbo")


def mode_name(mode: Any) -> str:
    """A ``cudagraph_mode`` (an enum member, or its name) by its name."""
    return str(getattr(mode, "name", mode))



@dataclass(frozen=True)
class GraphKey:
    """One split graph: vLLM's batch descriptor (what its ``CUDAGraphWrapper`` keys the graph by) and the token
    ranges of the plan fixed for it."""

    num_tokens: int
    num_reqs: int
    uniform: bool
    microbatches: tuple[tuple[int, int], ...]


def graph_plan(policy: SplitPolicy, desc: Any) -> SplitPlan | None:
    """The split fixed for the FULL graph of vLLM batch descriptor ``desc``, or None (vLLM's own unsplit graph).

    A descriptor is captured split when vLLM's dummy batch for it is a decode batch (one token per request: its
    ``num_reqs`` equals its ``num_tokens``, as vLLM builds it for uniform decode, and for FULL-mode descriptors up to
    ``max_num_seqs``), without LoRA, and the policy splits a decode step of that size."""
    if desc is None or getattr(desc, "has_lora", False) or desc.num_reqs != desc.num_tokens:
        return None
    return policy.plan(ForwardMode.DECODE, int(desc.num_tokens))


def graph_key(policy: SplitPolicy, desc: Any) -> GraphKey | None:
    """The `GraphKey` of ``desc``'s split graph, or None where vLLM's own graph serves it (`graph_plan`)."""
    plan = graph_plan(policy, desc)
    if plan is None:
        return None
    return GraphKey(int(desc.num_tokens), int(desc.num_reqs), bool(desc.uniform),
                    tuple((mb.tokens_start, mb.tokens_end) for mb in plan.microbatches))


def settle(own: Step, plan: SplitPlan) -> Step | None:
    """The step to replay from a split graph of ``plan`` (its padded size), or None: it runs eager.

    ``own`` is the step's own decision on its real tokens. It replays when that splits it as a decode step (one
    token per request) into as many microbatches as ``plan`` has, and every microbatch of ``plan`` holds a real
    token: it then runs ``plan``, the padding in its last microbatch."""
    if own.plan is None or own.forward_mode is not ForwardMode.DECODE or own.draft_tokens:
        return None
    if own.plan.num_microbatches != plan.num_microbatches or not 0 < own.num_tokens <= plan.num_tokens:
        return None
    if own.num_tokens <= plan.microbatches[-1].tokens_start:  # the last microbatch would be padding only
        return None
    return replace(own, plan=plan)


class SplitGraphs:
    """Per engine with a FULL ``cudagraph_mode``: which descriptors tbo captured split, and how each step of such a
    descriptor runs (module docstring). ``counters``: the `StepStats` that count replays, eager steps and captures."""

    def __init__(self, policy: SplitPolicy, counters: tuple[Any, ...]) -> None:
        self.policy, self.counters = policy, counters
        self.clock: Any = None  #: the layer loop's `StepClock`, started for each replay (set by the engine)
        #: vLLM batch descriptor -> the plan fixed in the split graph captured for it (its `GraphKey`: `graph_key`)
        self.captured: dict[Any, SplitPlan] = {}
        self.replays = self.eager_steps = 0

    def holds(self, full: bool, desc: Any) -> bool:
        """Whether a step dispatched to ``desc`` (FULL when ``full``) meets one of tbo's split graphs."""
        return full and desc in self.captured

    def settle(self, own: Step, desc: Any) -> Step | None:
        """A step dispatched FULL to ``desc``, which tbo captured split: the step to replay (counted here, as no
        Python of tbo's runs in a replay), or None: it runs eager (counted)."""
        plan = self.captured[desc]
        step = settle(own, plan)
        if step is None:
            self.eager_steps += 1
            for s in self.counters:
                s.graph_eager_steps += 1
            return None
        self.replays += 1
        if self.clock is not None:  # its time runs to the tokens, as an eager step's (the engine's loop's clock)
            self.clock.start(step.kind, True)
        for s in self.counters:
            s.record(step.kind, step.num_tokens, plan.num_microbatches, plan.two_chunk)
            s.graph_replays += 1
        return step

    def record(self, desc: Any, plan: SplitPlan) -> None:
        """``desc``'s FULL graph was captured split by ``plan``: its steps replay that plan (`settle`). Logged with
        its `GraphKey`, as vLLM logs its own captures."""
        self.captured[desc] = plan
        logger.info("tbo: split CUDA graph captured: %s", graph_key(self.policy, desc))

    def wrap(self, warmup_and_capture: Callable[..., Any], patches: Any) -> Callable[..., Any]:
        """vLLM's ``_warmup_and_capture(desc, cudagraph_runtime_mode, ...)`` for this runner: a FULL capture of a
        descriptor tbo splits runs, warm-ups and capture alike, with the step fixed to the size's plan."""

        @functools.wraps(warmup_and_capture)
        def _warmup_and_capture(desc: Any, cudagraph_runtime_mode: Any, *args: Any, **kwargs: Any) -> Any:
            plan = graph_plan(self.policy, desc) if mode_name(cudagraph_runtime_mode) == "FULL" else None
            if plan is None:  # not a split graph: vLLM's own
                return warmup_and_capture(desc, cudagraph_runtime_mode, *args, **kwargs)
            # uncounted, as vLLM's warm-ups
            step = Step(StepKind.WARMUP, ForwardMode.DECODE, int(desc.num_tokens), plan)
            with patches.fixed(step):
                out = warmup_and_capture(desc, cudagraph_runtime_mode, *args, **kwargs)
            self.record(desc, plan)
            for s in self.counters:
                s.graph_captures += 1
            return out

        return _warmup_and_capture
