"""Tensor parallelism with ``split: "adaptive"``: every TP worker makes the same choice for every step.

The TP workers of one engine run the same steps (vLLM broadcasts each step's batch to all of them), and their
all-reduces pair step by step: if one worker split a step the other ran whole, their collectives would not match
and both would wait out ``comm_timeout_s``. Each worker's `tbo.integrations.vllm.step.adaptive.AdaptiveSteps` is a
replica of one policy; what would set the replicas apart is their measurements, each worker timing its own steps.
So once per step, before choosing, the workers exchange their wall times of the previous step in one small
all-reduce over vLLM's TP CPU group (`tbo.split.agree.agree_step`, the data-parallel agreement's collective), and
every replica observes the same mean: the replicas stay equal and so do their choices, microbatch counts included.

The same exchange checks that the workers were given the same step (kind and token count) and run the same
configuration (`tbo.integrations.vllm.step.agree.agreement_config`, the data-parallel agreement's table, digested
once), and names the worker that did not. A worker that stalls or dies
makes it raise `CommTimeoutError` within ``comm_timeout_s`` (before the first served step, within
`tbo.integrations.vllm.step.agree.WARMUP_TIMEOUT_S`: the workers reach the profiling run as each finishes loading).
"""

from __future__ import annotations

from typing import Any

from tbo.integrations.vllm.step.agree import WARMUP_TIMEOUT_S
from tbo.split.agree import AgreedConfig, AgreementMismatchError, StepVote, agree_step
from tbo.split.kinds import Slot, StepKind

__all__ = ["TpStepTimes"]


class TpStepTimes:
    """``times(kind, tokens, measured_ns)``: this worker's wall time of the previous step (``measured_ns``, -1: none)
    exchanged with the other TP workers over ``group``; returns their mean in seconds (None: no worker measured
    one), the same number on every worker. ``kind`` and ``tokens`` describe the step about to be chosen: every
    worker must bring the same (`AgreementMismatchError` otherwise)."""

    def __init__(self, group: Any, timeout_s: float, config: Any = None) -> None:
        self.group, self.timeout_s = group, timeout_s
        self.config = AgreedConfig.of(config)  #: what shapes the workers' collectives, digested once
        self.exchanges = 0  #: the exchanges made: the step number each carries, so that workers a step apart are named
        self.serving = False  #: a served step was measured: the warm-up's longer deadline no longer applies

    def __call__(self, kind: StepKind, tokens: int, measured_ns: int) -> float | None:
        slot = Slot.DECODE if kind == StepKind.DECODE else Slot.PREFILL  # a vote carries a slot: a mixed step, prefill
        vote = StepVote(1, wants_split=True, can_split=True, mode=slot,
                        rows=(tokens,), measured_ns=measured_ns)
        timeout = self.timeout_s if self.serving else max(self.timeout_s, WARMUP_TIMEOUT_S)
        agreed = agree_step(vote, self.group, timeout, self.config, step=self.exchanges)
        self.exchanges += 1
        steps = [(v.mode, v.rows) for v in agreed.votes]
        if len(set(steps)) > 1:
            per_worker = ", ".join(f"worker {r}: {m} of {rows[0]} tokens" for r, (m, rows) in enumerate(steps))
            raise AgreementMismatchError(f"the tensor-parallel workers were given different steps ({per_worker}): "
                                         "they must run the same batch for their all-reduces to pair")
        measured = agreed.measured_s
        self.serving = self.serving or measured is not None
        return measured

