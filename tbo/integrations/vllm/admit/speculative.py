"""Speculative decoding through tbo: which ``speculative_config`` methods an engine with tbo admits.

A verify step (the target model over each request's 1 + k tokens) is split by `tbo.integrations.engine.step.decide`,
between requests only; vLLM's rejection sampler and spec-decode metadata see the whole step, unchanged. A proposer
that runs no model (``ngram``: prompt lookup on the host) has no draft pass to split. vLLM's MTP drafter runs a
decoder layer with an MoE once per draft token: its forwards run through tbo's layer loop too, each split by a
decision of its own (`tbo.integrations.vllm.runner.draft`). The other proposers that run a model (EAGLE, a draft model, ...)
would run it outside tbo's layer loop, so they are refused by name here rather than run unsplit behind a counter
that says otherwise.
"""

from __future__ import annotations

from typing import Any

from tbo.integrations.vllm.errors import refuse

__all__ = ["ADMITTED_METHODS", "check_speculative", "runs_draft_pass"]

#: method -> why tbo can run it
ADMITTED_METHODS = {
    "ngram": "prompt-lookup drafts proposed on the host; the target's verify steps are split between requests",
    "mtp": "the target's verify steps split between requests, and the MTP layer's forwards (a decoder layer with an "
           "MoE) split by tbo too, each by its own decision",
}


def runs_draft_pass(spec: Any) -> bool:
    """Whether tbo runs the drafter's model (`tbo.integrations.vllm.runner.draft.DraftPass`) for ``speculative_config``."""
    return spec is not None and getattr(spec, "method", None) == "mtp"


def check_speculative(spec: Any, parallel: Any = None, afd: bool = False) -> None:
    """Refuse a ``speculative_config`` whose method tbo does not run, naming it and what is accepted; and MTP where
    tbo does not run its draft pass (``parallel``: the engine's parallel config; ``afd``: attention-FFN
    disaggregation is on)."""
    method = getattr(spec, "method", None)
    if method not in ADMITTED_METHODS:
        why = ("its drafter runs a model of its own outside tbo's layer loop" if method in _MODEL_DRAFTERS
               else "not tested with tbo")
        refuse({"speculative_config method": method}, ", ".join(repr(m) for m in ADMITTED_METHODS)
                + ", or no speculative_config", why)
    if not runs_draft_pass(spec):
        return
    dp = getattr(parallel, "data_parallel_size", 1)
    if dp != 1:
        refuse({"speculative_config method": method}, "'ngram' with data_parallel_size > 1", f"with data_parallel_size={dp} every draft forward would need the ranks' agreement on its split, "
                "which tbo makes for target steps only (vLLM's proposer coordinates its own passes)")
    if afd:
        refuse({"speculative_config method": method}, "'ngram' with afd", "the MTP layer's MoE would run here, not on the FFN server")


#: vLLM methods whose drafter runs a model (``"mtp"`` is what vLLM names every ``*_mtp`` method, DeepSeek's included)
_MODEL_DRAFTERS = ("mtp", "eagle", "eagle3", "draft_model", "medusa", "mlp_speculator", "dflash", "dspark")
