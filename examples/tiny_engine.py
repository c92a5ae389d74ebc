"""A third engine on tbo's engine kit: a small continuous-batching engine, and the glue that puts tbo inside it.

Why this exists. vLLM and SGLang are not the only engines tbo's users run: teams have their own. What an engine
integration shares (the settings' schema, the refusal and its error, the split decision from a step's facts, the
adaptive driver, the step counters, their file and the shutdown summary, undoable patches) lives in
`tbo.integrations.engine` and imports no engine. This file shows what is then left to write:

* `TinyEngine` (the engine, not tbo's): requests with prompts, chunked prefill under a token budget, greedy decoding,
  a per-request KV cache; each step calls ``run_layers`` once, the seam tbo takes. Its model is the decoder layer of
  `examples/integrating.py` (docs/integrating.md walks that layer into ops).
* `TinyTbo` (the glue, under 90 lines): parses the settings with the kit's schema and refuses what this engine cannot
  run, by name; puts tbo in ``run_layers`` with the kit's undo stack; gathers each step's facts into the kit's
  `StepFacts` and lets the kit decide; runs, times and counts the layers with the kit's `EngineLayerLoop`; closes
  with the kit's summary.

    python examples/tiny_engine.py                                   # tbo off, then on: the same tokens
    python examples/tiny_engine.py --config '{"split": "adaptive", "adaptive": {"microbatches": [2, 3]}, "link": "500,0.2"}'
    python examples/tiny_engine.py --config '{"afd": {"ffn": "127.0.0.1:9"}}'   # refused by name

tests/test_examples.py runs it. Run from anywhere: it imports `integrating.py` from its own folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from integrating import EXPERTS, HIDDEN, LAYERS, META_RULES, MOE, MyMoELayer, _rms_norm  # noqa: E402

import tbo  # noqa: E402
from tbo.comm import LocalBackend  # noqa: E402
from tbo.comm.emulated import EmulatedLink  # noqa: E402
from tbo.integrations.engine.adaptive import AdaptiveSteps  # noqa: E402
from tbo.integrations.engine.config import StrategyNames, TboConfig, describe_error  # noqa: E402
from tbo.integrations.engine.errors import TboEngineError  # noqa: E402
from tbo.integrations.engine.loop import EngineLayerLoop  # noqa: E402
from tbo.integrations.engine.stats import StatsFile, StatsRegistry, StepStats, summary_line  # noqa: E402
from tbo.integrations.engine.step import StepFacts, decide_facts  # noqa: E402
from tbo.integrations.engine.undo import UndoStack  # noqa: E402
from tbo.split import Slot, split_inputs  # noqa: E402

VOCAB = 101


# ---- the engine (not tbo's) -------------------------------------------------------------------------------------
class TinyLM(torch.nn.Module):
    """Embedding, `LAYERS` of integrating.py's MoE layer, a final norm, an LM head (scaled: no near-ties)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=g)
        self.layers = [MyMoELayer(i, LocalBackend(EXPERTS)) for i in range(LAYERS)]
        self.head = torch.randn(HIDDEN, VOCAB, generator=g) * 4


@dataclass
class Request:
    req_id: str
    prompt: list[int]
    max_new: int
    out: list[int] = field(default_factory=list)
    computed: int = 0  #: tokens in the KV cache


class TinyEngine:
    """Every step schedules every unfinished request: one token for a decoding one, the next chunk of its prompt for a
    prefilling one, within ``max_step_tokens``; then samples greedily where a request's prompt is done."""

    def __init__(self, model: TinyLM, max_step_tokens: int = 16) -> None:
        self.model, self.max_step_tokens = model, max_step_tokens
        self.requests: list[Request] = []
        self.kv: dict = {}

    def add(self, req_id: str, prompt: list[int], max_new: int) -> None:
        self.requests.append(Request(req_id, prompt, max_new))

    def run_layers(self, x: torch.Tensor, meta: dict[str, Any], decoding: list[bool]) -> torch.Tensor:
        """The seam: the decoder layers over one step's packed tokens (``decoding[i]``: request i is past its
        prompt)."""
        for layer in self.model.layers:
            x = layer.forward(x, meta, self.kv)
        return x

    def step(self) -> None:
        budget, batch = self.max_step_tokens, []
        for r in (r for r in self.requests if len(r.out) < r.max_new):
            n = 1 if r.computed >= len(r.prompt) else min(len(r.prompt) - r.computed, budget)
            if n > 0:
                batch.append((r, n))
                budget -= n
        tokens = [t for r, n in batch for t in (r.prompt + r.out)[r.computed: r.computed + n]]
        meta = {"extend_lens": [n for _, n in batch], "prefix_lens": [r.computed for r, _ in batch],
                "req_ids": [r.req_id for r, _ in batch]}
        h = self.run_layers(self.model.embed[tokens], meta, [r.computed >= len(r.prompt) for r, _ in batch])
        last = torch.cumsum(torch.tensor(meta["extend_lens"]), 0) - 1
        logits = _rms_norm(h[last], torch.ones(HIDDEN)) @ self.model.head
        for (r, n), row in zip(batch, logits):
            r.computed += n
            if r.computed >= len(r.prompt):
                r.out.append(int(row.argmax()))

    def generate(self) -> dict[str, list[int]]:
        while any(len(r.out) < r.max_new for r in self.requests):
            self.step()
        return {r.req_id: r.out for r in self.requests}


# ---- the glue: tbo in TinyEngine, on the kit -------------------------------------------------------------------
class TinyTboError(TboEngineError):
    source = "TinyEngine's tbo settings"


#: the layer's own strategy, by name, so that settings can name it ("auto" means it here)
tbo.strategies.register(MOE.name, MOE, overwrite=True)
#: every TinyTbo of this process (the kit's registry: what a /metrics exporter or a stats() call would sum)
REGISTRY = StatsRegistry()


class TinyTbo:
    """tbo in one `TinyEngine`: built at start (a refusal leaves the engine as found), `close` takes it out."""

    def __init__(self, engine: TinyEngine, settings: Mapping[str, Any]) -> None:
        try:
            self.config = config = TboConfig.model_validate(dict(settings))
        except ValidationError as e:
            raise TinyTboError.about(dict(settings), describe_error(e)) from None
        if config.afd is not None:
            TinyTboError.refuse({"afd": settings["afd"]}, "settings without 'afd'",
                                "TinyEngine runs every layer in its own process, with no FFN server")
        if config.backend != "local":
            TinyTboError.refuse({"backend": config.backend}, "'local'", "TinyEngine has no DeepEP")
        names = StrategyNames(decode=MOE.name, prefill=MOE.name) if config.strategy == "auto" else \
            config.strategy_names(shared_experts=True)
        layers = engine.model.layers
        self.bound = {slot: tbo.strategies.bind_layers(layers, tbo.strategies.get(names.of(slot))) for slot in Slot}
        self.engine, self.stats, self.undo = engine, StepStats(), UndoStack()
        # `link`: the experts' transfers over an emulated wire, so that there is communication to hide on one CPU
        link = EmulatedLink.from_spec(layers[0].backend, config.link) if config.link else None
        for layer in layers if link else ():
            self.undo.set_attr(layer, "backend", link)
        self.adaptive = AdaptiveSteps(config, names, transfers=link is not None) if config.split == "adaptive" \
            else None
        if self.adaptive and link:
            self.adaptive.wire = lambda: link.booked_s
        for name in self.adaptive.extra_strategies() if self.adaptive else ():  # adaptive.strategies: checked now
            self.bound[name] = tbo.strategies.bind_layers(layers, tbo.strategies.get(name))
        self.policy = self.adaptive.policy if self.adaptive else config.split_policy()
        self.loop = EngineLayerLoop(layers, self.bound, layers[0].backend, stats=self.stats, op_times=config.op_times,
                                    stats_file=StatsFile(config.stats_file) if config.stats_file else None)
        self.undo.push("the registry's entry", REGISTRY.register(self.stats, self._report))
        self.undo.set_attr(engine, "run_layers", self.run_layers)
        self.undo.set_attr(engine, "step", self._measured(engine.step))

    def _report(self) -> Any:
        return self.adaptive.report() if self.adaptive else None

    def _measured(self, step: Callable[[], None]) -> Callable[[], None]:
        def measured() -> None:  # the adaptive split measures a step until its tokens are sampled
            step()
            if self.adaptive:
                self.adaptive.step_done()
        return measured

    def run_layers(self, x: torch.Tensor, meta: dict[str, Any], decoding: list[bool]) -> torch.Tensor:
        facts = StepFacts(scheduled=tuple(meta["extend_lens"]), past_prompt=tuple(decoding),
                          padded_tokens=x.shape[0])
        step = decide_facts(self.policy, facts)
        if self.adaptive:
            step = self.adaptive.decide(step, lambda policy: decide_facts(policy, facts))
        parts = split_inputs(meta, step.plan, request_keys=META_RULES)
        kv = self.engine.kv

        def pinned(mb: Any) -> dict:
            return {"meta": parts[0 if mb is None else mb.microbatch_idx], "kv": kv}

        run = self.loop.run(step, x, pinned=pinned, counted=True)  # the kit's: strategy, executor, op times
        self.loop.count(run)  # the kit's counters and stats_file
        return run.out["hidden_states"]

    def close(self) -> str:
        """Take tbo out of the engine (its seams as they were) and say what it did."""
        self.undo.close()
        return summary_line(self.stats)


# ---- tbo off, then on ----------------------------------------------------------------------------------------------
def serve(settings: Mapping[str, Any] | None) -> tuple[dict[str, list[int]], TinyEngine, TinyTbo | None]:
    engine = TinyEngine(TinyLM())
    g = torch.Generator().manual_seed(3)
    for i, n in enumerate((1, 7, 19, 3, 12, 30)):
        engine.add(f"req{i}", torch.randint(VOCAB, (n,), generator=g).tolist(), max_new=6)
    glue = TinyTbo(engine, settings) if settings is not None else None
    return engine.generate(), engine, glue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default='{"decode_token_threshold": 4, "prefill_token_threshold": 8}',
                        help="tbo's settings, as JSON (TboConfig's keys)")
    args = parser.parse_args()
    try:
        settings = json.loads(args.config)
        tokens, engine, glue = serve(settings)  # first: a refusal comes before any work
        truth, _, _ = serve(None)
    except (TboEngineError, tbo.StrategyError) as e:
        sys.exit(f"refused: {e}")
    assert glue is not None
    print(f"tokens: {'equal' if tokens == truth else 'DIFFER'} ({sum(map(len, truth.values()))} tokens, "
          f"{len(truth)} requests)")
    s = glue.stats
    print(f"steps: {s.steps}, split: {s.split_steps}, microbatches: {s.microbatches}, cut requests: {s.cut_requests}")
    print("by mode: " + ", ".join(f"{m} {s.split_steps_by_mode[m]}/{s.steps_by_mode[m]}"
                                  for m in s.steps_by_mode if s.steps_by_mode[m]))
    print("unsplit by reason: " + (", ".join(f"{why} {n}" for why, n in sorted(s.unsplit_steps_by_reason.items()))
                                   or "none"))
    if glue.adaptive:
        print("adaptive: " + "; ".join(glue.adaptive.report()["summary"]))
    print(glue.close())
    print(f"closed: run_layers restored: {engine.run_layers.__func__ is TinyEngine.run_layers}, "
          f"registry: {len(REGISTRY)}")
    assert tokens == truth, "tbo changed the tokens"


if __name__ == "__main__":
    main()
