"""`StepDecider`: the one place a step of an engine is decided, in the pipeline's order, and published once.

For each of vLLM's ``_determine_batch_execution_and_padding`` calls (`tbo.integrations.vllm.runner.patches` hands
it over as a `RunnerCall`), the decider runs:

1. **vLLM's own decision** (`VllmDecision`), first: its padding and CUDA-graph dispatch are facts tbo decides on;
2. a fixed step, inside a split graph's capture (`fixed`: every decision is the size's plan), or, for a step vLLM
   dispatched to a FULL graph tbo captured split, the **graph's settlement** (`tbo.integrations.vllm.step.graphs`:
   replay the size's plan, or run eager by vLLM's own eager decision);
3. otherwise **tbo's own decision** on the runner's batch (`tbo.integrations.engine.step.decide`, asked through the
   call), honouring vLLM's prefix-cache veto, then the **adaptive choice** (`tbo.integrations.vllm.step.adaptive`);
4. with data parallelism instead, the **agreement** with the other DP ranks (`tbo.integrations.vllm.step.agree`),
   before vLLM's own decision, which its DP batch coordination then answers from the agreement.

The result is published once (`step`, which tells `on_step`: the forward each step runs,
`tbo.integrations.vllm.runner.forwards`) and read by the layer loop; vLLM gets its tuple back with tbo's
``should_ubatch``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from tbo.integrations.engine.step import Step
from tbo.integrations.vllm.step.batch import VllmDecision
from tbo.split import ForwardMode, SplitPolicy
from tbo.split.kinds import StepKind

__all__ = ["RunnerCall", "StepDecider"]


class RunnerCall(Protocol):
    """One call of vLLM's ``_determine_batch_execution_and_padding``, as the decider asks it."""

    num_tokens: int  #: the call's ``num_tokens`` (the step's scheduled tokens, unpadded)
    num_reqs: int

    def vllm(self, force_eager: bool = False) -> VllmDecision:
        """vLLM's own decision for the call (``force_eager``: as an eager step, unpadded)."""

    def coordinated(self, coordinate: Callable[..., Any]) -> VllmDecision:
        """vLLM's own decision through ``coordinate`` (its DP batch coordination answered by the agreement)."""

    def allowed(self) -> bool:
        """vLLM's prefix-cache veto, asked as if its microbatching were on: False vetoes a split."""

    def own(self, allowed: bool, padded_tokens: int, policy: SplitPolicy | None = None) -> Step:
        """tbo's own decision on the runner's batch (with ``policy``: planned with it instead of the decider's)."""


class StepDecider:
    """Per engine: decides each step (module docstring) and holds the step being run."""

    def __init__(self, policy: SplitPolicy, adaptive: Any = None) -> None:
        self.policy = policy
        #: ``split: "adaptive"``: turns each decided step into the measured choice's
        #: (`tbo.integrations.vllm.step.adaptive.AdaptiveSteps`); None: the policy's thresholds decide
        self.adaptive = adaptive
        #: a FULL ``cudagraph_mode``: the split graphs, which settle the steps vLLM dispatches to them
        #: (`tbo.integrations.vllm.step.graphs.SplitGraphs`); None: no CUDA graphs of split steps
        self.graphs: Any = None
        #: data parallel: settles each step with the other DP ranks (``agree(step, vetoed) -> Step``) and runs vLLM's
        #: DP batch coordination for it (``agree.coordinate``): `tbo.integrations.vllm.step.agree.StepAgreementHook`;
        #: None: this engine decides alone
        self.agree: Any = None
        #: called with each step as it is decided, and with None when the step is over (where vLLM runs unsplit
        #: steps: `tbo.integrations.vllm.runner.forwards.StepForwards.on_step` picks the forward the step runs)
        self.on_step: Callable[[Step | None], None] | None = None
        self.fixed: Step | None = None  #: inside a split graph's capture: the step every decision returns
        self.dummy: StepKind | None = None  #: inside a data-parallel dummy run: its Step's kind (idle or warmup)
        self._step: Step | None = None

    @property
    def step(self) -> Step | None:
        """The current execute_model call's decision; None outside one."""
        return self._step

    @step.setter
    def step(self, step: Step | None) -> None:
        self._step = step
        if self.on_step is not None:
            self.on_step(step)

    def determine(self, call: RunnerCall) -> tuple[Any, ...]:
        """vLLM's decision tuple for ``call``, with tbo's ``should_ubatch``; the step decided is `step`."""
        if self.agree is not None:
            return self._agreed(call)
        decision = call.vllm()
        if self.fixed is not None:  # a split graph's warm-up or capture: the size's plan
            self.step = self.fixed
            return decision.split(self.fixed.runner_split)
        if self.graphs is not None and self.graphs.holds(decision.full_graph, decision.batch_desc):
            return self._settled(call, decision)
        desc = decision.batch_desc
        allowed = call.allowed() and desc.num_reqs in (None, call.num_reqs)
        step = call.own(allowed, desc.num_tokens)
        if self.adaptive is not None:  # the measured choice's; planned again where it chose another count
            step = self.adaptive.decide(step, lambda policy: call.own(allowed, desc.num_tokens, policy))
        self.step = step  # one decision, told once
        return decision.split(self.step.runner_split)

    def _settled(self, call: RunnerCall, decision: VllmDecision) -> tuple[Any, ...]:
        """A step vLLM dispatched to a FULL graph tbo captured split: replayed with the size's plan, or, where its
        own decision (on its real tokens) differs, run eager by vLLM's own eager decision (`tbo.integrations.vllm.
        step.graphs`)."""
        own = call.own(call.allowed(), call.num_tokens)
        step = self.graphs.settle(own, decision.batch_desc)
        if step is None:  # its split differs from its graph's: eager, unpadded, split by its own plan or not
            decision, step = call.vllm(force_eager=True), own
        self.step = step
        return decision.split(step.runner_split)

    def _agreed(self, call: RunnerCall) -> tuple[Any, ...]:
        """Data parallel: agree with the other ranks first (tbo's deadline bounds that wait: a stalled or dead peer
        is named there, before vLLM's own DP all-reduce, which tbo's deadline does not bound), then vLLM's own
        decision, its DP batch coordination answered from the agreement or under the agreement's deadline."""
        num_tokens = call.num_tokens
        if self.dummy is not None:  # a dummy run: nothing of its own to split; it takes part in its peers' steps
            step, vetoed = Step(self.dummy, ForwardMode.DECODE, num_tokens, None, unsplit_reason="idle"), False
        else:  # no CUDA graphs (admit/graphs.py): vLLM pads no DP step, so the plan's token count is the runner's
            allowed = call.allowed()
            step, vetoed = call.own(allowed, num_tokens), not allowed
        step = self.step = self.agree(step, vetoed)
        decision = call.coordinated(self.agree.coordinate)
        if step.plan is not None and decision.batch_desc.num_tokens != num_tokens:
            raise RuntimeError(f"tbo agreed to split a step of {num_tokens} tokens, but vLLM's runner padded it to "
                               f"{decision.batch_desc.num_tokens}: its microbatches would not be the plan's")
        return decision.split(step.runner_split)
