"""A DeepSeek-V3 checkpoint with an MTP layer, as vLLM's DeepSeek MTP loads it, made from a saved random model.

vLLM's ``DeepSeekMTP`` (``model_executor/models/deepseek_mtp.py``) reads MTP layer i of a checkpoint of
``num_hidden_layers`` layers at ``model.layers.{num_hidden_layers + i}``: a whole decoder layer (attention and MoE),
beside the layer's ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` (its ``shared_head.head`` and the
embedding are shared with the target's when the checkpoint has none), with ``num_nextn_predict_layers`` in the
config. `add_mtp_layer` turns a saved ``L + 1``-layer DeepSeek-V3 checkpoint into that: an ``L``-layer model whose
last saved layer becomes its MTP layer's block.

With random weights an MTP layer's drafts are as good as random, and no draft would ever be accepted. So
``frequent_tokens`` get their ``lm_head`` rows scaled by ``boost``, as real vocabularies have frequent tokens: the
target emits them often, and so does the MTP layer, whose head is the target's; drafts and targets then agree on
some of them (about one draft in ten on the tests' model), while which token wins where still depends on every
layer's math.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

__all__ = ["add_mtp_layer"]


def add_mtp_layer(path: Path, *, frequent_tokens: Sequence[int] = (7, 77), boost: float = 4.0, seed: int = 1) -> Path:
    """Make the DeepSeek-V3 checkpoint at ``path`` (saved with ``L + 1`` layers, one safetensors file) an ``L``-layer
    model with one MTP layer (the saved layer ``L``); returns ``path``."""
    import torch
    from safetensors.torch import load_file, save_file

    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    layers = int(config["num_hidden_layers"]) - 1
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    config_path.write_text(json.dumps(config, indent=2))
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    hidden = int(config["hidden_size"])
    dtype = tensors["lm_head.weight"].dtype
    prefix = f"model.layers.{layers}"
    g = torch.Generator().manual_seed(seed)
    tensors[f"{prefix}.enorm.weight"] = torch.ones(hidden, dtype=dtype)
    tensors[f"{prefix}.hnorm.weight"] = torch.ones(hidden, dtype=dtype)
    tensors[f"{prefix}.eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=g) * 0.1).to(dtype)
    tensors[f"{prefix}.shared_head.norm.weight"] = torch.ones(hidden, dtype=dtype)
    tensors["lm_head.weight"][list(frequent_tokens)] *= boost
    tensors[f"{prefix}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, weights, metadata={"format": "pt"})
    return path
