"""`AFDFFNServer`: the FFN side's loop. Receive a microbatch's hidden states, run that layer's FFN, send the result back.

Requests are served in arrival order from all of this FFN rank's attention ranks; the header says which layer and
stage each belongs to. The loop ends when every attention rank has sent its shutdown message.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from tbo.afd.connector import AFDMeta, TorchDistributedAFDConnector

__all__ = ["AFDFFNServer"]


class AFDFFNServer:
    def __init__(self, model: Any, connector: TorchDistributedAFDConnector) -> None:
        self.model, self.connector = model, connector
        self.received: list[AFDMeta] = []  #: every request's metadata, in arrival order
        #: seconds spent computing FFNs, by the requests' ``num_microbatches``: how busy DBO keeps this rank, and how
        #: much more work two half-size FFN calls cost than one full-size call
        self.busy_s: defaultdict[int, float] = defaultdict(float)

    def serve(self) -> int:
        """Serve until all attention peers shut down; return how many requests were served."""
        remaining = set(self.connector.topology.attention_peers(self.connector.rank))
        served = 0
        while remaining:
            hidden, meta = self.connector.recv_attn_output()
            if meta.shutdown:
                remaining.discard(meta.src)
                continue
            if not 0 <= meta.layer_idx < len(self.model.layers):
                raise ValueError(f"rank {meta.src} asked for layer {meta.layer_idx}; the model has "
                                 f"{len(self.model.layers)}")
            self.received.append(meta)
            t0 = time.perf_counter()
            out = self.model.layers[meta.layer_idx].ffn(hidden)
            self.busy_s[meta.num_microbatches] += time.perf_counter() - t0
            self.connector.send_ffn_output(out, meta)
            served += 1
        self.connector.flush()
        return served
