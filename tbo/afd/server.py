"""`AFDFFNServer`: the FFN side's loop. Receive a microbatch's hidden states, run that layer's FFN, send the result back.

Requests are served in arrival order from all of this FFN rank's attention ranks; the header says which layer and
stage each belongs to. The loop ends when every attention rank has sent its shutdown message. What it keeps per
request is bounded: the last ``log_size`` headers (`received`) and counters, so a server that runs for days holds
the same memory on its last request as on its thousandth.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import Any

from tbo.afd.connector import AFDMeta, TorchDistributedAFDConnector

__all__ = ["AFDFFNServer"]


class AFDFFNServer:
    def __init__(self, model: Any, connector: TorchDistributedAFDConnector, log_size: int = 4096) -> None:
        if log_size < 0:
            raise ValueError(f"log_size={log_size} must be >= 0")
        self.model, self.connector = model, connector
        #: the last ``log_size`` requests' metadata, in arrival order (older ones are counted in `served` only)
        self.received: deque[AFDMeta] = deque(maxlen=log_size)
        self.served = 0  #: requests served so far
        #: seconds spent computing FFNs, by the requests' ``num_microbatches``: how busy DBO keeps this rank, and how
        #: much more work two half-size FFN calls cost than one full-size call
        self.busy_s: defaultdict[int, float] = defaultdict(float)

    def serve(self) -> int:
        """Serve until all attention peers shut down; return how many requests were served."""
        remaining = set(self.connector.topology.attention_peers(self.connector.rank))
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
            self.served += 1
        self.connector.flush()
        return self.served
