"""The kit: what every engine integration of tbo shares, importing no engine. The one config schema (`config`:
`TboConfig`), the one error type and message shape (`errors`: `TboEngineError`, each room's error a subclass), the
rules that decide a step's split (`step`: a step's kind, its plan, speculative verify and draft steps), the adaptive
driver (`adaptive`: `AdaptiveSteps`, which requires its caller to plan a step again), the counters of what tbo did
(`stats`), the undo stack an engine is built on (`undo`), and what reaches an engine's ``/metrics`` and its live
trace route from the processes that run the model (`metrics`: the shared-memory slots and their families;
`live_trace`: the trace request, its recording and what a route does with it).

vLLM's integration (`tbo.integrations.vllm`) and SGLang's (`tbo.integrations.sglang`) take them from here; neither
imports the other (tests/test_layering.py), and a third engine writes only its glue (docs/integrating.md).
"""
