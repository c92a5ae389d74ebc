"""Attention-FFN disaggregation with dual-batch overlap: config, connector, attention-side ops, FFN server."""

from .attention import AFDAttentionLayer, AFDAttentionModel
from .config import AFD_NUM_STAGES, AFDConfig
from .connector import AFDConnector, AFDMeta, AFDTopology, TorchDistributedAFDConnector
from .server import AFDFFNServer

__all__ = ["AFDAttentionLayer", "AFDAttentionModel", "AFDConfig", "AFDConnector", "AFDFFNServer", "AFDMeta",
           "AFDTopology", "AFD_NUM_STAGES", "TorchDistributedAFDConnector"]
