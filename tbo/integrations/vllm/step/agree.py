"""Data-parallel attention with expert parallelism: what the plugin accepts, and the one agreement per step.

vLLM's ``--data-parallel-size N --enable-expert-parallel`` runs one engine per DP rank, each with its own requests,
and spreads the experts over the ranks (tbo carries their traffic: `tbo.integrations.vllm.model.ep_layer`). Every dispatch
then needs every rank, so the ranks must run the same sequence of collectives. Once per forward step, the runner's
real steps and its dummy steps alike, each rank votes (`tbo.split.agree.StepVote`) and one all-reduce over vLLM's
DP group (its gloo CPU group) settles, the same on every rank:

* whether to split: when at least one rank's policy planned a split and no rank vetoes it (vLLM's prefix-cache
  rule: a request reading blocks another request of the same step writes). A rank whose own tokens are too few (or none: an idle rank's dummy step) still runs the
  agreed microbatches, all its tokens in the first and the others empty (`DpStep.empty_tail`);
* the microbatch count (the same config on every rank, checked);
* the strategy: prefill when any rank prefills, decode otherwise (their collectives come in different orders);
* every rank's token rows in each microbatch (`DpStep.rows`): the dispatches send by them, padded, and none waits on a
  row-count exchange with its peers (`tbo.comm.alltoall`);
* that every rank runs the same configuration (`agreement_config`, digested once): a rank started otherwise is
  `tbo.split.agree.AgreementMismatchError` naming the key, on every rank, at warm-up.

The profiling and warm-up runs vote too (every rank runs the same ones), so their collectives match; they are not
counted in `stats`; their agreements wait up to `WARMUP_TIMEOUT_S` (the ranks finish loading at different times). A
peer that dies or stalls while serving makes the wait raise `CommTimeoutError` naming this rank and the op, within
``comm_timeout_s``; vLLM's own waits on its DP peers (its batch coordination here, its engine-loop all-reduce in the
engine core: `bounded_engine_sync`) get the same deadline and name (`call_bounded`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tbo.core.errors import CommTimeoutError
from tbo.integrations.engine.step import Step, microbatch_rows
from tbo.integrations.vllm.comm.bounded import call_bounded
from tbo.integrations.vllm.errors import refuse
from tbo.integrations.vllm.step.batch import VllmDecision
from tbo.split import ForwardMode
from tbo.split.agree import MAX_AGREED_MICROBATCHES, AgreedConfig, StepVote, agree_step
from tbo.split.index import Cut
from tbo.split.kinds import Slot, StepKind
from tbo.split.plan import SplitPlan, plan_from_cuts

#: the deadline of the agreements of the profiling and warm-up runs (at least ``comm_timeout_s``): the ranks reach
#: them as each finishes loading the model, which under load may be minutes apart
WARMUP_TIMEOUT_S = 600.0

__all__ = ["DpStep", "StepAgreementHook", "WARMUP_TIMEOUT_S", "agreement_config", "empty_tail_plan"]


@dataclass(frozen=True)
class DpStep:
    """What the data-parallel ranks agreed for one step beyond its plan and strategy (`Step.dp`)."""

    #: the plan puts every token in microbatch 0 and leaves the others empty: they run only for their collectives
    #: (vLLM's runner runs the step unsplit)
    empty_tail: bool = False
    #: per microbatch (one entry unsplit), the token rows every DP rank runs in it, indexed by rank
    #: (`tbo.split.agree.StepAgreement.rows`); its dispatches send by them, with no count exchange. None: not agreed
    rows: tuple[tuple[int, ...], ...] | None = None
    #: every rank runs a dummy step (vLLM's wave-end steps): no dispatch has a row to carry and vLLM discards a
    #: dummy step's output, so the layer stack does not run (`tbo.integrations.vllm.runner.loop.LayerLoop`)
    all_idle: bool = False



def empty_tail_plan(num_tokens: int, num_microbatches: int) -> SplitPlan:
    """A plan with every token in microbatch 0 and ``num_microbatches - 1`` empty ones after it."""
    cuts = [Cut(num_tokens, 1, False)] * (num_microbatches - 1)
    return plan_from_cuts(ForwardMode.EXTEND, [num_tokens], cuts)


def _vote_of(step: Step) -> Slot | StepKind:
    """What ``step`` votes for: the slot its own batch needs, or idle for a dummy or warm-up run."""
    if step.kind in (StepKind.IDLE, StepKind.WARMUP):
        return StepKind.IDLE
    return step.own_slot  # a verify step is decode-like


class StepAgreementHook:
    """Called by `RunnerPatches` with this rank's own `Step`; returns the step every rank agreed to run."""

    def __init__(self, num_microbatches: int, group: Any, timeout_s: float, config: Any = None,
                 adaptive: Any = None, merges_coordination: bool = False, stats: tuple[Any, ...] = ()) -> None:
        if num_microbatches > MAX_AGREED_MICROBATCHES:
            refuse({"num_microbatches": num_microbatches}, f"at most {MAX_AGREED_MICROBATCHES} with data parallel", "the step agreement carries every rank's rows per microbatch in a table of fixed width")
        self.num_microbatches, self.group, self.timeout_s = num_microbatches, group, timeout_s
        #: what shapes this rank's collectives (`agreement_config`), digested once, checked in every agreement
        self.config = AgreedConfig.of(config)
        self.last: Any = None  #: the last `StepAgreement` (for tests and logs)
        #: ``split: "adaptive"``: chooses each agreed step's split from the ranks' shared step times
        #: (`tbo.integrations.vllm.step.adaptive.AdaptiveSteps.agreed`); None: the thresholds decide
        self.adaptive = adaptive
        #: the agreement answers vLLM's DP batch coordination (`coordinate`): True when no CUDA graph pads a step
        #: (from the engine's compilation config, the same on every rank: its ``cudagraph_mode`` is agreed)
        self.merges_coordination = merges_coordination
        #: where `coordinate` counts the steps whose vLLM DP batch coordination ran its own all-reduce
        #: (``StepStats.vllm_dp_all_reduces``)
        self.stats = stats
        #: the agreements made so far: the step number each one carries, so that ranks a step apart are named
        #: (`agree_step`'s ``step``), not paired
        self.steps_agreed = 0

    def __call__(self, step: Step, vetoed: bool) -> Step:
        adaptive = self.adaptive
        vote = StepVote(self.num_microbatches, wants_split=step.plan is not None, can_split=not vetoed,
                        mode=_vote_of(step), rows=microbatch_rows(step.plan, step.num_tokens, self.num_microbatches),
                        measured_ns=-1 if adaptive is None else adaptive.measured_ns)
        # the profiling and warm-up runs wait for peers still loading their weights: a slow start is no fault
        timeout = max(self.timeout_s, WARMUP_TIMEOUT_S) if step.kind == StepKind.WARMUP else self.timeout_s
        try:
            agreed = self.last = agree_step(vote, self.group, timeout, self.config, step=self.steps_agreed)
            self.steps_agreed += 1
        except CommTimeoutError as e:
            raise CommTimeoutError(f"{e}: a data-parallel peer did not reach this step: it stalled or died, or "
                                   "(offline, without vLLM's DP coordinator) it has no requests in this wave (none in "
                                   "this generate call, or the wave ended before this rank's requests reached its "
                                   "engine), and an engine without requests does not step for its peers") from e
        # a wave's end: every rank steps only for its peers, none has any
        if step.kind == StepKind.IDLE and agreed.all_idle:
            return replace(step, plan=None, agreed_slot=agreed.slot, dp=DpStep(all_idle=True),
                           unsplit_reason="idle")
        split, slot, name = agreed.split, agreed.slot, None
        if adaptive is not None and agreed.idle_ranks < len(agreed.votes):  # every rank alike: see AdaptiveSteps
            choice, slot = adaptive.agreed(agreed)
            split, name = choice.split, adaptive.bound_name(slot, choice)
        if not split:
            plan, empty_tail = None, False
        elif step.plan is not None:
            plan, empty_tail = step.plan, False
        else:
            plan, empty_tail = empty_tail_plan(step.num_tokens, agreed.num_microbatches), True
        rows = agreed.rows
        if rows is not None and agreed.split and not split:  # the policy keeps it whole: each rank's total rows
            rows = (tuple(sum(per_rank) for per_rank in zip(*rows)),)
        why = None if plan is not None else "adaptive" if agreed.split else \
            step.unsplit_reason if step.plan is None else "data_parallel"  # a peer could not, or wanted no split
        return replace(step, plan=plan, agreed_slot=slot, strategy_name=name,
                       dp=DpStep(empty_tail, rows), unsplit_reason=why)

    def coordinate(self, determine: Any, /, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``_determine_batch_execution_and_padding`` (``determine``) for the step just agreed on.

        vLLM's DP batch coordination there all-reduces each rank's token count again (with its microbatching
        and CUDA-graph flags), right after the agreement that already carried every rank's rows. Where that is
        all it would learn (no CUDA graphs: nothing pads, `merges_coordination`), ``determine`` runs under vLLM's
        own ``skip_dp_coordination`` and the token counts come from the agreement: one collective per step instead
        of two. Otherwise vLLM's all-reduce runs, under this hook's deadline, naming a stalled or lost peer."""
        counts = self.last.tokens_per_rank if self.last is not None and self.merges_coordination else None
        if counts is None:
            for s in self.stats:
                s.vllm_dp_all_reduces += 1
            return call_bounded(self.group, self.timeout_s, "vLLM's DP batch coordination (all_reduce)", determine,
                                *args, **kwargs)
        import torch
        from vllm.v1.worker.dp_utils import skip_dp_coordination

        with skip_dp_coordination():
            decision = VllmDecision.of(determine(*args, **kwargs))
        if decision.across_dp is None:
            return decision.as_tuple()
        # what vLLM's all-reduce gives without padding: each rank's own count
        return replace(decision, across_dp=torch.tensor(counts, dtype=torch.int32)).as_tuple()


def agreement_config(engine: Any) -> dict[str, Any]:
    """Everything of ``engine`` (a `TboEngine`) that shapes its collectives, for the step agreement to compare over
    the ranks: the strategy each step kind runs (its name and bound op list), the microbatch count, the backend and
    its layout and payload (FP8 rows or not), ``agreed_rows``, the link, and the model's expert shapes and dtype
    (the dispatches' sizes; a dense model has none). A rank started otherwise gets
    `tbo.split.agree.AgreementMismatchError` naming the key, at warm-up. The TP workers' step-time exchange compares
    the same table (`tbo.integrations.vllm.step.tp`)."""
    config, vllm_config = engine.config, engine.runner.vllm_config
    hf = vllm_config.model_config.hf_text_config
    top_k = getattr(hf, "num_experts_per_tok", None)
    backend = getattr(engine.backend, "inner", engine.backend)  # under an emulated link: the backend it wraps
    return {
        "strategy": config.strategy, "num_microbatches": config.num_microbatches, "agreed_rows": config.agreed_rows,
        "split": config.split, "adaptive": config.adaptive,
        "backend": config.backend, "deepep_kind": config.deepep_kind, "deepep_decode": config.deepep_decode,
        "link": config.link,
        "fp8_dispatch": engine.fp8_dispatch,  # the dispatches' payload: FP8 rows with scales, or the model's dtype
        "cudagraph_mode": str(vllm_config.compilation_config.cudagraph_mode),  # whether `coordinate` merges
        **{f"strategy.{mode}": s for mode, s in engine.strategies.items()},
        "backend.layout": f"{type(backend).__name__} {getattr(getattr(backend, 'format', None), 'name', None)} "
                          f"{getattr(backend, 'num_experts', None)} experts over {getattr(backend, 'num_ranks', None)}",
        "model": f"{engine.architecture} hidden {hf.hidden_size}, {'dense' if top_k is None else f'top-{top_k}'}, "
                 f"{len(engine.layers)} layers, {vllm_config.model_config.dtype}",
    }




