"""``"split": "adaptive"`` inside vLLM: the engine-neutral driver (`tbo.integrations.engine.adaptive.AdaptiveSteps`),
as vLLM's runner drives it.

The step's clock runs from the decision (`tbo.integrations.vllm.step.decider`, which hands the driver the step and
``replan``: the same step decided again, prefix-cache veto included, with the chosen count's policy) to the end of
``sample_tokens``, where vLLM's runner waits for the step's sampled tokens anyway (`step_done`). The decider's policy
has the most microbatches: one attention metadata builder each. With data parallelism the ranks' agreement carries
each rank's time of the previous step (`AdaptiveSteps.agreed`, from `tbo.integrations.vllm.step.agree`) and several
counts are refused at engine start; with tensor parallelism the workers exchange their times before each choice
(`tbo.integrations.vllm.step.tp.TpStepTimes`, set as `AdaptiveSteps.shared`); over emulated links the engine sets
`AdaptiveSteps.wire` to their booked time (one DP rank).
"""

from __future__ import annotations

from tbo.integrations.engine.adaptive import AdaptiveSteps

__all__ = ["AdaptiveSteps"]
