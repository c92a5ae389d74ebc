"""`EpBackend`: tbo's all-to-all over an engine's expert-parallel group, counting the rows that crossed ranks.

Why in the kit: every engine that runs expert parallelism through tbo's own all-to-all (vLLM under DP attention,
SGLang with its experts spread over the TP ranks) needs the same backend and the same proof that rows travelled
(``remote_rows`` in ``stats_file`` and ``/metrics``); only the group it runs over is the engine's.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from tbo.comm.alltoall import TorchDistributedBackend
from tbo.comm.types import DispatchFormat

__all__ = ["EpBackend"]


class EpBackend(TorchDistributedBackend):
    """tbo's all-to-all over an engine's expert-parallel group, NORMAL layout, counting the token rows it sends to other
    ranks (``remote_rows``: the traffic a run with every expert local would not have)."""

    def __init__(self, num_experts: int, group: Any, timeout_s: float) -> None:
        super().__init__(num_experts, DispatchFormat.NORMAL, group=group, timeout_s=timeout_s)
        #: the rows sent to other ranks, summed on the device by each dispatch (never read inside a step)
        self._remote: torch.Tensor | None = None

    @property
    def remote_rows(self) -> int:
        """Token rows this backend's dispatches sent to other ranks so far: one host read, here, of what the
        dispatches counted on the device (a dispatch inside a step that must not read the host reads nothing)."""
        return 0 if self._remote is None else int(self._remote)

    def dispatch_a(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                   rows_per_rank: Sequence[int] | None = None) -> Any:
        state = super().dispatch_a(hidden, topk_idx, topk_weights, rows_per_rank=rows_per_rank)
        sent = state.info["route"].send_counts
        remote = sent.sum() - sent[self.rank]
        self._remote = remote if self._remote is None else self._remote + remote
        return state
