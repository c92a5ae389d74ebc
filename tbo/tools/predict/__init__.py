"""Will TBO pay on a cluster not yet measured? Predict it from hardware and model specs.

`predict` turns a `Hardware` preset, a `ModelShape` and a `Deployment` into the simulator's `CostModel` (rooflines
per op, DeepEP transfers from message sizes) for the built-in strategies, so `simulate`, `compare`, `recommend`,
`find_threshold` and `tune` answer for that cluster; `split_policy` gives the `SplitPolicy` thresholds. `memory_use`
says whether the deployment fits in the GPU's memory at all (weights, KV cache, DeepEP buffers).
``benchmarks/published.py`` holds the predictions against DeepEP's and SGLang's published measurements.

    >>> from tbo.tools.predict import Deployment, predict
    >>> p = predict("h800", "deepseek-v3", Deployment(ep=32, tokens_per_device=256, context=4096, kv_bytes=1))
    >>> p.memory.fits and p.compare().speedup > 1
    True

This is a tool: the library never imports it.
"""

from tbo.tools.predict.comm import Traffic, expected_reached, traffic, transfer_seconds
from tbo.tools.predict.costs import Kernel, Prediction, layer_kernels, predict, split_policy
from tbo.tools.predict.hardware import DEFAULT_EFFICIENCY, FITTED_FACTORS, HARDWARE, Efficiency, Hardware, get_hardware
from tbo.tools.predict.memory import MemoryUse, memory_use
from tbo.tools.predict.model import MODELS, Deployment, ModelShape, get_model

__all__ = [
    "DEFAULT_EFFICIENCY", "Deployment", "Efficiency", "FITTED_FACTORS", "HARDWARE", "Hardware", "Kernel", "MODELS",
    "MemoryUse", "ModelShape", "Prediction", "Traffic", "expected_reached", "get_hardware", "get_model",
    "layer_kernels", "memory_use", "predict", "split_policy", "traffic", "transfer_seconds",
]
