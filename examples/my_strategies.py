"""A user's own strategy kept in code: a lead-1, four-stage variant of the Qwen3-MoE decode strategy, registered when
the module is imported. docs/strategies.md ("Your own strategy in an engine") checks it with `tbo --import
examples.my_strategies lint mine --layer-kind vllm-moe` and serves it in vLLM by value (its JSON in
``additional_config["tbo"]["strategies"]``) or by this module (``"strategy_modules": ["my_strategies"]``).
"""

import tbo.strategies
from tbo import OperationsStrategy, Yield

mine = OperationsStrategy(name="mine", delta_stages=1, operations=[
    "comm_prepare_attn", "attn_prepare", Yield,
    "attn_core", "comm_prepare_mlp", "gate", "select_experts", "dispatch_a", Yield,
    "dispatch_b", "experts", "combine_a", Yield,
    "combine_b", "output", "comm_postprocess_layer"])
tbo.strategies.register("mine", mine, overwrite=True)
