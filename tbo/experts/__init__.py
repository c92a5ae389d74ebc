"""Expert compute: the plain-torch runner for every dispatch layout, the DeepGEMM grouped-GEMM runner, and the FP8
per-token-group quantisation both share with FP8 dispatch.

These are compute, not communication: a backend moves rows to the rank that owns an expert, and an expert runner
multiplies them there, in whatever layout the backend produced.
"""

from tbo.experts.run import ExpertFn, StackedSwiGLU, masked_path, run_experts

__all__ = ["ExpertFn", "StackedSwiGLU", "masked_path", "run_experts"]
