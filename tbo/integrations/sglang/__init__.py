"""tbo inside SGLang: a plugin (entry point group ``sglang.srt.plugins``) that runs an SGLang MoE model's layer loop
through tbo's split policy, strategies and executor, idle unless ``TBO_SGLANG_CONFIG`` holds its JSON config.

A room of sub-packages by concern, as the vLLM one: `errors` (the one error type), `config` (the shared schema,
read at engine start), `stats` (per engine, summed per process), `model` (admission by structure and the layer as
ops), `step` (the split decision and the per-microbatch ForwardBatches, from SGLang's own preparer), `runner` (the
engine built in undoable steps, the layer loop, the microbatch contexts) and `plugin` (the entry point). See
docs/sglang.md.
"""

from tbo.integrations.sglang.stats import reset_stats, stats

__all__ = ["reset_stats", "stats"]
