"""`tbo.integrations.vllm.runner.cpu.request_amx_tiles` (no vLLM needed): asked on a CPU with AMX tiles, held after,
and nothing asked elsewhere. The engine case it exists for: tests/vllm/test_quant.py's DP = 2 + EP int4 engine,
whose rank 1 worker died of an illegal instruction without it on an AMX CPU."""

from __future__ import annotations

import torch

from tbo.integrations.vllm.runner.cpu import request_amx_tiles


def test_amx_permission_is_asked_on_an_amx_cpu_only():
    amx = torch.cpu._is_amx_tile_supported()
    assert request_amx_tiles(torch.device("cpu")) is amx  # held where the CPU has AMX tiles (torch's own request)
    assert request_amx_tiles("cpu") is amx  # idempotent: asked again, still held
    assert request_amx_tiles("meta") is False  # not a CPU: nothing asked
