"""The bfloat16 oracle of the vLLM suites: tbo's bf16 tokens must be as faithful to the model as vLLM's own.

Why not "equal tokens up to near ties". Measured on the suites' tiny DeepSeek-V3 (``initializer_range`` 0.2, drawn
wide so that a wrong token cannot pass as a tie), 50 greedy positions: vLLM's bf16 log-probability of the token it
chose differs from vLLM's fp32 one by up to 1.7 nats, vLLM's own bf16 decode and prefill paths disagree by up to
0.5 nats on the same context, and the fp32 top-2 gap has a median of 0.5 nats. bf16 therefore flips tokens at
positions that no fixed near-tie bound separates from a defect, and *which* positions flip depends on the CPU's
float bits: tbo over DP = 2 + EP (whose combine rounds each rank's partial sum to bf16, as every expert-parallel
combine does) gave vLLM's tokens on one machine and, on another, at one position the fp32 model's own choice
where vLLM's bf16 (0.69 nats below fp32's top) did not: the old rule failed it. Taming the weights is no way out:
with the body drawn at 0.02 bf16 still moves log-probabilities by 0.3 nats, while zeroing the experts' output
changes the argmax at only 1% of positions: a test blind to the feature it checks.

The rule: the float32 model judges both engines. Each engine's bf16 tokens are fed back, after their prompt, to
vLLM's float32 engine without tbo (teacher forcing, ``prompt_logprobs``), which gives at every generated position
the *regret* of the token chosen there: fp32's top log-probability minus fp32's log-probability of that token (0
where the bf16 engine chose fp32's argmax). tbo's mean regret may exceed vLLM's own by at most ``REGRET_SLACK``. Every
generated position of every request is judged, whatever happened before it (each engine's own context), and the
count is asserted. The judge runs in float32, where vLLM's tokens do not depend on the CPU (the fp32 tests compare
them exactly). What it catches: `test_engine.test_bf16_oracle_fails_vllm_without_the_rotary_fix` runs it on vLLM's
own bf16 DeepSeek with its CPU rotary defect left in (tokens that depend on the batch), and it fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: nats: how much tbo's mean regret may exceed vLLM's. Correct bf16 engines measured 0.02 to 0.06 mean regret (one
#: flipped position among 50 adds up to 0.035); a wrong attention or experts computation picks tokens the model
#: ranks far lower (mean regret well above 0.3).
REGRET_SLACK = 0.15


def fp32_regrets(llm: Any, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[float]]:
    """Per request and generated position, fp32's regret of the token ``outputs`` chose there (``llm``: a float32
    engine without tbo; see the module docstring)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False, prompt_logprobs=1)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p) + list(o)) for p, o in zip(prompts, outputs,
                                                                                           strict=True)],
                        params, use_tqdm=False)
    regrets = []
    for p, o, out in zip(prompts, outputs, outs, strict=True):
        positions = out.prompt_logprobs[len(p):]
        assert len(positions) == len(o), (len(positions), len(o))
        # each position's dict holds the token there and fp32's top-1
        regrets.append([max(lp.logprob for lp in pos.values()) - pos[t].logprob for t, pos in zip(o, positions)])
    return regrets


def assert_as_faithful_as_vllm(fp32_llm: Any, prompts: list[list[int]], got: list[list[int]],
                               want: list[list[int]], max_tokens: list[int]) -> int:
    """tbo's bf16 tokens ``got`` against vLLM's own bf16 tokens ``want`` for ``prompts``, judged by ``fp32_llm``
    (module docstring). Asserts every request's full length; returns the number of positions judged."""
    assert len(got) == len(want) == len(prompts) == len(max_tokens), (len(got), len(want), len(prompts))
    for r, (g, w, n) in enumerate(zip(got, want, max_tokens)):
        assert len(g) == len(w) == n, f"request {r}: tbo {len(g)} tokens, vLLM {len(w)}, asked {n}"
    ours, theirs = fp32_regrets(fp32_llm, prompts, got), fp32_regrets(fp32_llm, prompts, want)
    judged = sum(map(len, ours))
    assert judged == sum(max_tokens) > 0, (judged, sum(max_tokens))
    mean_ours, mean_theirs = sum(map(sum, ours)) / judged, sum(map(sum, theirs)) / judged
    worst = sorted(((x, r, i) for r, row in enumerate(ours) for i, x in enumerate(row)), reverse=True)[:3]
    assert mean_ours <= mean_theirs + REGRET_SLACK, (
        f"tbo's bf16 tokens are less faithful to the fp32 model than vLLM's: mean regret {mean_ours:.3f} nats "
        f"against vLLM's {mean_theirs:.3f} (+{REGRET_SLACK} allowed) over {judged} positions; worst (regret, "
        f"request, position): {[(round(x, 3), r, i) for x, r, i in worst]}; tokens equal to vLLM's at "
        f"{sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))} positions")
    return judged


def reference_fp32(model: Path, engine: dict[str, Any]) -> Any:
    """The judge: vLLM's float32 engine for ``model`` with the suite's rotary fix (`helpers._reference_llm`), as
    a context manager."""
    from .helpers import _reference_llm

    return _reference_llm(model, **{**engine, "dtype": "float32"})
