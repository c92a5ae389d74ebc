"""The strategy catalogue: DeepSeek and Qwen3-MoE decode/prefill, AFD, dense layers, tensor-parallel layers (their
all-reduces overlapped), and a registry for your own.

    >>> import tbo.strategies as S
    >>> S.names()
    ['afd_attention_dbo', 'deepseek_decode', 'deepseek_prefill', 'dense_tp_decode', 'dense_tp_prefill', 'moe_tp_decode', 'moe_tp_ep_decode', 'moe_tp_ep_prefill', 'moe_tp_prefill', 'qwen3_moe_decode', 'qwen3_moe_prefill']
    >>> S.get("deepseek_decode").delta_stages
    2
"""

from tbo.strategies.afd import afd_attention_dbo
from tbo.strategies.auto import AutoNames, auto_names, auto_names_for_layers
from tbo.strategies.budget import sized_for
from tbo.strategies.deepseek import deepseek_decode, deepseek_prefill
from tbo.strategies.dense import DENSE_OPS, LayerStrategies, bind_layers, dense_like
from tbo.strategies.qwen3_moe import qwen3_moe_decode, qwen3_moe_prefill
from tbo.strategies.registry import get, names, register, unregister
from tbo.strategies.sources import import_modules, parse_strategy, register_from_config
from tbo.strategies.tensor_parallel import (dense_tp_decode, dense_tp_prefill, moe_tp_decode, moe_tp_ep_decode,
                                            moe_tp_ep_prefill, moe_tp_prefill)

for _factory in (deepseek_decode, deepseek_prefill, qwen3_moe_decode, qwen3_moe_prefill, afd_attention_dbo,
                 dense_tp_decode, dense_tp_prefill, moe_tp_decode, moe_tp_prefill, moe_tp_ep_decode, moe_tp_ep_prefill):
    register(_factory.__name__, _factory)
del _factory

__all__ = [
    "AutoNames",
    "DENSE_OPS",
    "afd_attention_dbo",
    "auto_names",
    "auto_names_for_layers",
    "LayerStrategies",
    "bind_layers",
    "deepseek_decode",
    "deepseek_prefill",
    "dense_like",
    "dense_tp_decode",
    "dense_tp_prefill",
    "get",
    "import_modules",
    "moe_tp_decode",
    "moe_tp_ep_decode",
    "moe_tp_ep_prefill",
    "moe_tp_prefill",
    "names",
    "parse_strategy",
    "qwen3_moe_decode",
    "qwen3_moe_prefill",
    "register",
    "register_from_config",
    "sized_for",
    "unregister",
]
