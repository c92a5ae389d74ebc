"""The step pipeline: each forward step decided once, in order: tbo's own decision (`tbo.integrations.engine.step`,
on vLLM's batch), a captured split graph's plan (`graphs`), the adaptive choice (`adaptive`), the data-parallel
agreement (`agree`); then handed to vLLM as microbatch slices (`slices`).
"""
