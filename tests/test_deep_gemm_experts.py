"""The DeepGEMM expert runner against the deep_gemm CPU stand-in (its argument contracts), both name generations."""

import pytest
import torch

from tbo.comm import DispatchFormat, LocalBackend
from tbo.experts import run_experts
from tbo.experts.deep_gemm import DeepGemmSwiGLUExperts
from tbo.experts.deep_gemm import DEEP_GEMM_NAMES, resolve_deep_gemm
from tbo.experts.fp8 import dequantize_per_block, quantize_per_block
from tbo.testing import deep_gemm_standin
from tbo.testing.moe import SwiGLUExperts, make_routing

H, I, E = 128, 128, 4


@pytest.mark.parametrize("old_names", [False, True])
@pytest.mark.parametrize("fmt", [DispatchFormat.MASKED, DispatchFormat.EXPANDED])
def test_deep_gemm_runner_matches_plain_torch(monkeypatch, old_names, fmt):
    deep_gemm_standin.install(monkeypatch, old_names=old_names)
    experts = SwiGLUExperts.build(E, H, I, seed=1)
    runner = DeepGemmSwiGLUExperts(experts.w_gate, experts.w_up, experts.w_down, out_dtype=torch.float32)
    backend = LocalBackend(E, fmt)
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(2))
    idx, w = make_routing(20, E, 2, seed=3)
    d = backend.dispatch_b(backend.dispatch_a(x, idx, w))
    got = backend.combine_b(backend.combine_a(runner(d), d.handle))
    d2 = backend.dispatch_b(backend.dispatch_a(x, idx, w))
    want = backend.combine_b(backend.combine_a(run_experts(d2, experts.local(0, E)), d2.handle))
    # FP8 activations and weights: a few percent, relative to the output's scale
    assert (got - want).norm() / want.norm() < 0.08


def test_name_fallback_chain(monkeypatch):
    deep_gemm_standin.install(monkeypatch, old_names=True)
    assert resolve_deep_gemm("masked").__name__ == "m_grouped_masked"
    assert DEEP_GEMM_NAMES["masked"][0] == "fp8_m_grouped_gemm_nt_masked"  # newest first
    with pytest.raises(ValueError, match="unknown DeepGEMM layout"):
        resolve_deep_gemm("ragged")


def test_missing_deep_gemm_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    with pytest.raises(ImportError, match="DeepGEMM masked expert runner needs the optional package 'deep_gemm'"):
        resolve_deep_gemm("masked")


def test_standin_rejects_what_deep_gemm_rejects(monkeypatch):
    mod = deep_gemm_standin.install(monkeypatch)
    q, s = quantize_per_block(torch.randn(2, 128, 128))
    lhs = (torch.randn(2, 4, 128), torch.ones(2, 4, 1))  # not FP8
    with pytest.raises(deep_gemm_standin.DeepGemmContractError, match="float8_e4m3fn"):
        mod.fp8_m_grouped_gemm_nt_masked(lhs, (q, s), torch.empty(2, 4, 128), torch.tensor([1, 2],
                                         dtype=torch.int32), 2)


def test_block_quantisation_round_trip():
    w = torch.randn(3, 256, 128)
    q, s = quantize_per_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2, 1)
    assert (dequantize_per_block(q, s) - w).abs().max() < 0.07 * w.abs().max()
    with pytest.raises(ValueError, match="multiple of the 128x128"):
        quantize_per_block(torch.randn(100, 128))
