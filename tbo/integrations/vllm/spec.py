"""Speculative decoding through tbo: which ``speculative_config`` methods an engine with tbo admits.

A verify step (the target model over each request's 1 + k tokens) is split by `tbo.integrations.vllm.step.decide`,
between requests only; vLLM's rejection sampler and spec-decode metadata see the whole step, unchanged. A proposer
that runs no model (``ngram``: prompt lookup on the host) has no draft pass to split. A proposer that runs a model
of its own (MTP, EAGLE, a draft model) runs it outside tbo's layer loop, so it is refused by name here rather than
run unsplit behind a counter that says otherwise.
"""

from __future__ import annotations

from typing import Any

from tbo.integrations.vllm.checks import _refuse

__all__ = ["ADMITTED_METHODS", "check_speculative"]

#: method -> why tbo can run it
ADMITTED_METHODS = {
    "ngram": "prompt-lookup drafts proposed on the host; the target's verify steps are split between requests",
}


def check_speculative(spec: Any) -> None:
    """Refuse a ``speculative_config`` whose method tbo does not run, naming it and what is accepted."""
    method = getattr(spec, "method", None)
    if method in ADMITTED_METHODS:
        return
    why = ("its drafter runs a model of its own outside tbo's layer loop" if method in _MODEL_DRAFTERS
           else "not tested with tbo")
    _refuse("speculative_config method", method, ", ".join(repr(m) for m in ADMITTED_METHODS)
            + ", or no speculative_config", why)


_MODEL_DRAFTERS = ("mtp", "eagle", "eagle3", "draft_model", "medusa", "mlp_speculator", "dflash", "dspark")
