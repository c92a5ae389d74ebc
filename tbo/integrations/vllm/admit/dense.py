"""Dense models (no MoE layer), checked when the model loads, once its layers show there is no expert traffic: tbo
admits them under tensor parallelism, where each layer ends its attention and its MLP in an all-reduce that tbo runs
as its transfer (`tbo.integrations.vllm.model.tp`), and refuses by name what leaves nothing to overlap.
"""

from __future__ import annotations

from tbo.integrations.vllm.errors import TboConfigError, refuse

__all__ = ["check_dense_model"]


def check_dense_model(architecture: str, *, tensor_parallel_size: int, data_parallel_size: int,
                      compiled: bool) -> None:
    """Accept a dense model at TP >= 2, data parallel 1, eager; refuse every other setting by name."""
    if tensor_parallel_size < 2:
        raise TboConfigError(
            f"tbo cannot run {architecture} at tensor_parallel_size {tensor_parallel_size}: nothing to overlap. None "
            "of its decoder layers has a MoE (no expert traffic to hide) and one rank makes no tensor-parallel "
            "all-reduce either, so a split step would only run the layers twice as small batches; serve it at "
            "tensor_parallel_size >= 2, where tbo overlaps one microbatch's all-reduces with the other's compute, "
            "or without additional_config['tbo']")
    if data_parallel_size != 1:
        refuse({"data_parallel_size": data_parallel_size}, "1 for a dense model (tensor parallelism within it)",
               "a dense model has no expert traffic between data-parallel ranks; tbo overlaps its tensor-parallel "
               "all-reduces")
    if compiled:
        refuse({"enforce_eager": False}, "True for a dense model under tensor parallelism",
               "its deferred all-reduces (o_proj's and down_proj's reduce_results off for tbo's call) are tested "
               "eager only")
