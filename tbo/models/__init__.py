"""A small, real DeepSeek-V3-style / Qwen3-MoE-style decoder in plain torch, built to be run through tbo."""

from tbo.models.cache import AttentionMetadata, KVCache, StaticAttentionMetadata, StaticKVCache
from tbo.models.config import ModelConfig
from tbo.models.decoder import STATE_FLOW, DecoderLayer, ReferenceModel

__all__ = ["AttentionMetadata", "DecoderLayer", "KVCache", "ModelConfig", "ReferenceModel", "STATE_FLOW",
           "StaticAttentionMetadata", "StaticKVCache"]
