"""The executor's contract for layers: the ``_a``/``_b`` op mixins engines' layers inherit (`tbo.ops.transfers`).

Engine-neutral and model-neutral: the vLLM and SGLang adapters, the Hugging Face layer and the reference model all
take their dispatch/combine and tensor-parallel reduction ops from here.
"""

from tbo.ops.transfers import TP_REDUCE_OPS, ExpertParallelOps, TensorParallelOps

__all__ = ["ExpertParallelOps", "TensorParallelOps", "TP_REDUCE_OPS"]
