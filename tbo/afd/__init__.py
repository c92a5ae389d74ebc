"""Attention-FFN disaggregation with dual-batch overlap: config, connector, attention-side ops, FFN server."""

from tbo.afd.attention import AFDAttentionLayer, AFDAttentionModel
from tbo.afd.config import AFD_NUM_MICROBATCHES, AFDConfig
from tbo.afd.connector import AFDConnector, AFDMeta, AFDTopology, TorchDistributedAFDConnector
from tbo.afd.server import AFDFFNServer

__all__ = ["AFDAttentionLayer", "AFDAttentionModel", "AFDConfig", "AFDConnector", "AFDFFNServer", "AFDMeta",
           "AFDTopology", "AFD_NUM_MICROBATCHES", "TorchDistributedAFDConnector"]
