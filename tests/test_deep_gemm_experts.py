"""The DeepGEMM expert runner (FP8 and BF16) against the deep_gemm CPU stand-in (its argument contracts), across the
name generations."""

import pytest
import torch

from tbo.comm import DispatchFormat, DispatchOutput, LocalBackend
from tbo.experts import run_experts
from tbo.experts.deep_gemm import DeepGemmSwiGLUExperts
from tbo.experts.deep_gemm import DEEP_GEMM_NAMES, contiguous_alignment, resolve_deep_gemm
from tbo.comm.fp8 import (dequantize_per_block, dequantize_per_token_group, quantize_per_block,
                          quantize_per_token_group)
from tbo.testing import deep_gemm_standin
from tbo.testing.moe import SwiGLUExperts, make_routing

H, I, E = 128, 128, 4


def _through(runner, fmt, x, idx, w):
    backend = LocalBackend(E, fmt)
    d = backend.dispatch_b(backend.dispatch_a(x, idx, w))
    return backend.combine_b(backend.combine_a(runner(d), d.handle))


def _reference(experts, fmt, x, idx, w):
    backend = LocalBackend(E, fmt)
    d = backend.dispatch_b(backend.dispatch_a(x, idx, w))
    return backend.combine_b(backend.combine_a(run_experts(d, experts.local(0, E)), d.handle))


def _fp8_reference(experts, fmt, x, idx, w, ue8m0=False, rows=None):
    """What DeepGEMM's FP8 SwiGLU computes, written out on the dequantised FP8 operands: each expert's rows and
    weights quantised (per token group, per 128x128 block) and dequantised, a float32 GEMM rounded to BF16, SiLU(gate)
    * up in float32 quantised again, the down GEMM rounded to BF16. Only the GEMM kernel is left to the path, so the
    two agree bit for bit: any scale, layout or rounding step the runner gets wrong shows. ``rows``: the dispatched
    rows as (FP8, scales), when they arrive quantised."""
    def fp8(t):
        return dequantize_per_token_group(*quantize_per_token_group(t, round_scale=ue8m0))

    def block(t):
        return dequantize_per_block(*quantize_per_block(t.transpose(-1, -2).contiguous(), round_scale=ue8m0))

    w13 = block(torch.cat([experts.w_gate, experts.w_up], dim=-1))  # [E, 2I, H], NT as DeepGEMM takes it
    w2 = block(experts.w_down)  # [E, H, I]

    def fn(e, x_e):
        gate_up = (fp8(x_e) @ w13[e].T).to(torch.bfloat16).float()
        act = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]
        return (fp8(act) @ w2[e].T).to(torch.bfloat16)

    backend = LocalBackend(E, fmt)
    d = backend.dispatch_b(backend.dispatch_a(x, idx, w))
    if rows is not None:  # FP8-dispatched rows: the first GEMM takes them as they are
        d = DispatchOutput(d.format, dequantize_per_token_group(*rows), d.tokens_per_expert, d.handle)
    # the runner's BF16 rows go to the combine, which sums them in float32 and returns BF16
    return backend.combine_b(backend.combine_a(run_experts(d, fn), d.handle)).to(torch.bfloat16)


def _batch(n=20):
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(2))
    idx, w = make_routing(n, E, 2, seed=3)
    return x, idx, w


@pytest.mark.parametrize("generation", ["fp8_fp4", "fp8", "legacy"])
@pytest.mark.parametrize("fmt", [DispatchFormat.MASKED, DispatchFormat.EXPANDED])
def test_deep_gemm_runner_matches_plain_torch(monkeypatch, generation, fmt):
    mod = deep_gemm_standin.install(monkeypatch, generation=generation)
    experts = SwiGLUExperts.build(E, H, I, seed=1)
    runner = DeepGemmSwiGLUExperts(experts.w_gate, experts.w_up, experts.w_down)
    x, idx, w = _batch()
    got, want = _through(runner, fmt, x, idx, w).float(), _reference(experts, fmt, x, idx, w)
    assert torch.equal(got, _fp8_reference(experts, fmt, x, idx, w).float())
    assert (got - want).norm() / want.norm() < 0.08  # and FP8's error against float32 is what FP8 costs
    layout = "masked" if fmt is DispatchFormat.MASKED else "contiguous"
    assert mod.calls == [DEEP_GEMM_NAMES[layout][{"fp8_fp4": 0, "fp8": 1, "legacy": -1}[generation]]] * 2


@pytest.mark.parametrize("generation", ["fp8_fp4", "fp8"])
@pytest.mark.parametrize("fmt", [DispatchFormat.MASKED, DispatchFormat.EXPANDED])
def test_bf16_path_runs_the_bf16_gemms_without_fp8(monkeypatch, generation, fmt):
    mod = deep_gemm_standin.install(monkeypatch, generation=generation)
    experts = SwiGLUExperts.build(E, H, I, seed=1)
    x, idx, w = _batch()
    want = _reference(experts, fmt, x, idx, w)
    bf16 = DeepGemmSwiGLUExperts(experts.w_gate, experts.w_up, experts.w_down, precision="bf16")
    assert bf16.w13.dtype == torch.bfloat16 and bf16.w2.dtype == torch.bfloat16  # not quantised
    got = _through(bf16, fmt, x.to(torch.bfloat16), idx, w).float()
    layout = "masked" if fmt is DispatchFormat.MASKED else "contiguous"
    assert mod.calls == [f"m_grouped_bf16_gemm_nt_{layout}"] * 2  # no FP8 kernel ran
    bf16_err = ((got - want).norm() / want.norm()).item()
    fp8 = DeepGemmSwiGLUExperts(experts.w_gate, experts.w_up, experts.w_down)
    fp8_err = ((_through(fp8, fmt, x, idx, w).float() - want).norm() / want.norm()).item()
    assert bf16_err < 0.02 and bf16_err < fp8_err / 2, (bf16_err, fp8_err)  # BF16 rounding only, well under FP8's


def test_bf16_path_takes_fp8_dispatched_rows(monkeypatch):
    deep_gemm_standin.install(monkeypatch)
    experts = SwiGLUExperts.build(E, H, I, seed=1)
    x, idx, w = _batch()
    backend = LocalBackend(E, DispatchFormat.MASKED)
    d = backend.dispatch_b(backend.dispatch_a(x, idx, w))
    q, s = quantize_per_token_group(d.hidden)
    fp8_rows = DispatchOutput(d.format, q, d.tokens_per_expert, d.handle, scales=s)  # as DeepEP FP8 dispatch gives
    bf16 = DeepGemmSwiGLUExperts(experts.w_gate, experts.w_up, experts.w_down, precision="bf16")
    got = backend.combine_b(backend.combine_a(bf16(fp8_rows).float(), d.handle))
    want = _reference(experts, DispatchFormat.MASKED, x, idx, w)
    assert (got - want).norm() / want.norm() < 0.08


def test_bf16_path_needs_deep_gemm_with_bf16_gemms(monkeypatch):
    deep_gemm_standin.install(monkeypatch, generation="legacy")
    experts = SwiGLUExperts.build(E, H, I, seed=1)
    bf16 = DeepGemmSwiGLUExperts(experts.w_gate, experts.w_up, experts.w_down, precision="bf16")
    with pytest.raises(ImportError, match="has none of m_grouped_bf16_gemm_nt_masked.*DeepGEMM >= 2.0; "
                                          "precision='fp8'"):
        _through(bf16, DispatchFormat.MASKED, *_batch())
    with pytest.raises(ValueError, match="BF16 grouped GEMMs write bfloat16"):
        DeepGemmSwiGLUExperts(experts.w_gate, experts.w_up, experts.w_down, torch.float32, precision="bf16")
    with pytest.raises(ValueError, match="precision must be 'fp8' or 'bf16'"):
        DeepGemmSwiGLUExperts(experts.w_gate, experts.w_up, experts.w_down, precision="fp4")


def test_name_fallback_chain(monkeypatch):
    assert DEEP_GEMM_NAMES["masked"][0] == "m_grouped_fp8_fp4_gemm_nt_masked"  # newest first
    assert set(DEEP_GEMM_NAMES["masked"]) >= {"m_grouped_fp8_gemm_nt_masked", "fp8_m_grouped_gemm_nt_masked"}
    mod = deep_gemm_standin.install(monkeypatch)  # today's: canonical names, older ones as aliases of the same
    assert resolve_deep_gemm("masked") is mod.m_grouped_fp8_fp4_gemm_nt_masked is mod.fp8_m_grouped_gemm_nt_masked
    assert resolve_deep_gemm("bf16_contiguous").__name__ == "m_grouped_bf16_gemm_nt_contiguous"
    mod.m_grouped_fp8_fp4_gemm_nt_masked = None  # a version that retired a name by setting it to None
    assert resolve_deep_gemm("masked") is mod.m_grouped_fp8_gemm_nt_masked
    deep_gemm_standin.install(monkeypatch, old_names=True)
    assert resolve_deep_gemm("masked").__name__ == "m_grouped_gemm_fp8_fp8_bf16_nt_masked"
    assert contiguous_alignment() == 128  # asked under its old name
    with pytest.raises(ValueError, match="unknown DeepGEMM layout"):
        resolve_deep_gemm("ragged")


def test_missing_deep_gemm_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    with pytest.raises(ImportError, match="DeepGEMM masked expert runner needs the optional package 'deep_gemm'"):
        resolve_deep_gemm("masked")


def _contract_error(fn, *args):
    with pytest.raises(deep_gemm_standin.DeepGemmContractError) as info:
        fn(*args)
    return str(info.value)


def test_standin_rejects_what_deep_gemm_rejects(monkeypatch):
    mod = deep_gemm_standin.install(monkeypatch)
    q, s = quantize_per_block(torch.randn(2, 128, 128))
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    lhs = (torch.randn(2, 4, 128), torch.ones(2, 4, 1))  # not FP8
    out = torch.empty(2, 4, 128, dtype=torch.bfloat16)
    assert "float8_e4m3fn" in _contract_error(mod.fp8_m_grouped_gemm_nt_masked, lhs, (q, s), out, i32(1, 2), 2)
    fp8_lhs = quantize_per_token_group(torch.randn(2, 4, 128))
    assert "expected_m must be a positive int" in _contract_error(
        mod.m_grouped_fp8_fp4_gemm_nt_masked, fp8_lhs, (q, s), out, i32(1, 2), 0)


def test_standin_enforces_the_bf16_contracts(monkeypatch):
    mod = deep_gemm_standin.install(monkeypatch)
    bf = lambda *shape: torch.randn(*shape).to(torch.bfloat16)  # noqa: E731
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    masked, contiguous = mod.m_grouped_bf16_gemm_nt_masked, mod.m_grouped_bf16_gemm_nt_contiguous
    a, b, out = bf(2, 4, 64), bf(2, 32, 64), torch.empty(2, 4, 32, dtype=torch.bfloat16)
    masked(a, b, out, i32(3, 0), 3)  # well formed
    assert torch.equal(out[0, :3], (a[0, :3].float() @ b[0].float().T).to(torch.bfloat16))
    assert "a of a BF16 GEMM must be a bfloat16 tensor, got torch.float32" in _contract_error(
        masked, a.float(), b, out, i32(3, 0), 3)
    assert "d of a BF16 GEMM must be a bfloat16" in _contract_error(masked, a, b, out.float(), i32(3, 0), 3)
    assert "b must be [groups, N, K] (NT) with K=64" in _contract_error(masked, a, bf(2, 64, 32), out, i32(3, 0), 3)
    assert "out must be (2, 4, 32)" in _contract_error(masked, a, b, out[:, :, :16], i32(3, 0), 3)
    assert "masked_m must be int32 [2]" in _contract_error(masked, a, b, out, torch.tensor([3, 0]), 3)
    assert "in [0, 4] (the capacity)" in _contract_error(masked, a, b, out, i32(5, 0), 3)
    assert "expected_m must be a positive int" in _contract_error(masked, a, b, out, i32(3, 0), 2.5)
    rows, d = bf(256, 64), torch.empty(256, 32, dtype=torch.bfloat16)
    aligned = torch.cat([torch.full((128,), 0), torch.full((100,), 1), torch.full((28,), -1)]).int()
    contiguous(rows, b, d, aligned)  # well formed: group 1 starts on a 128-row boundary
    assert "mix groups [0, 1]" in _contract_error(
        contiguous, rows, b, d, torch.cat([torch.full((100,), 0), torch.full((156,), 1)]).int())
    assert "multiple of 128" in _contract_error(contiguous, rows[:200], b, d[:200], aligned[:200])
    assert "m_indices must be int32 [256]" in _contract_error(contiguous, rows, b, d, aligned.long())
    assert "m_indices must be in [-1, 2)" in _contract_error(contiguous, rows, b, d, aligned + 1)
    assert "FP8 tensor, scales) pair" in _contract_error(mod.m_grouped_fp8_gemm_nt_contiguous, rows, b, d, aligned)


def test_block_quantisation_round_trip():
    w = torch.randn(3, 256, 128)
    q, s = quantize_per_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2, 1)
    assert (dequantize_per_block(q, s) - w).abs().max() < 0.07 * w.abs().max()
    with pytest.raises(ValueError, match="multiple of the 128x128"):
        quantize_per_block(torch.randn(100, 128))


def test_fp8_gemms_write_bf16_only(monkeypatch):
    """DeepGEMM's FP8 grouped GEMMs assert a BF16 output (gemm.hpp:193, :275): the runner refuses float32 up front,
    and the stand-in refuses it at the call, as DeepGEMM does."""
    mod = deep_gemm_standin.install(monkeypatch)
    experts = SwiGLUExperts.build(E, H, I, seed=1)
    with pytest.raises(ValueError, match="out_dtype=torch.float32: DeepGEMM's FP8 grouped GEMMs write bfloat16"):
        DeepGemmSwiGLUExperts(experts.w_gate, experts.w_up, experts.w_down, out_dtype=torch.float32)
    q, s = quantize_per_block(torch.randn(2, 128, 128))
    lhs = quantize_per_token_group(torch.randn(2, 4, 128))
    i32 = torch.tensor([1, 2], dtype=torch.int32)
    assert "output of an FP8 grouped GEMM must be bfloat16, got torch.float32" in _contract_error(
        mod.m_grouped_fp8_fp4_gemm_nt_masked, lhs, (q, s), torch.empty(2, 4, 128), i32, 2)
    rows = quantize_per_token_group(torch.randn(128, 128))
    assert "must be bfloat16, got torch.float32" in _contract_error(
        mod.m_grouped_fp8_fp4_gemm_nt_contiguous, rows, (q, s), torch.empty(128, 128), torch.zeros(128).int())
    mod.m_grouped_fp8_fp4_gemm_nt_masked(lhs, (q, s), torch.empty(2, 4, 128, dtype=torch.bfloat16), i32, 2)


@pytest.mark.parametrize("fmt", [DispatchFormat.MASKED, DispatchFormat.EXPANDED])
def test_sm100_takes_ue8m0_scales(monkeypatch, fmt):
    """SM100's DeepGEMM keeps only the exponent of float32 scales: the stand-in (arch=10) refuses scales that are
    not powers of two, which the runner's default on SM90 makes; with ``ue8m0`` (chosen by the device) they are."""
    deep_gemm_standin.install(monkeypatch, arch=10)
    experts = SwiGLUExperts.build(E, H, I, seed=1)
    x, idx, w = _batch()
    sm90 = DeepGemmSwiGLUExperts(experts.w_gate, experts.w_up, experts.w_down)
    assert sm90.ue8m0 is False  # no CUDA here: ue8m0_wanted() says SM90's float scales
    with pytest.raises(deep_gemm_standin.DeepGemmContractError, match="not powers of two: SM100 casts"):
        _through(sm90, fmt, x, idx, w)
    sm100 = DeepGemmSwiGLUExperts(experts.w_gate, experts.w_up, experts.w_down, ue8m0=True)
    got = _through(sm100, fmt, x, idx, w).float()
    assert torch.equal(got, _fp8_reference(experts, fmt, x, idx, w, ue8m0=True).float())
    assert not torch.equal(got, _fp8_reference(experts, fmt, x, idx, w, ue8m0=False).float())  # the scales matter


def test_ue8m0_packed_scales_are_sm100_only(monkeypatch):
    """DeepEP low-latency's ``use_ue8m0`` gives int32-packed exponents: SM100's DeepGEMM reads them, SM90's refuses
    them (gemm.hpp:286-295, "Unsupported architecture or scaling factor types")."""
    from tbo.comm.fp8 import pack_ue8m0

    experts = SwiGLUExperts.build(E, H, I, seed=1)
    x, idx, w = _batch()
    backend = LocalBackend(E, DispatchFormat.MASKED)
    d = backend.dispatch_b(backend.dispatch_a(x, idx, w))
    q, s = quantize_per_token_group(d.hidden, round_scale=True)
    packed = DispatchOutput(d.format, q, d.tokens_per_expert, d.handle, scales=pack_ue8m0(s))
    assert packed.scales.dtype == torch.int32 and packed.scales.shape[-1] == H // 512 + (H % 512 > 0)
    runner = DeepGemmSwiGLUExperts(experts.w_gate, experts.w_up, experts.w_down, ue8m0=True)
    deep_gemm_standin.install(monkeypatch, arch=9)
    with pytest.raises(deep_gemm_standin.DeepGemmContractError, match="scales must be float32 on SM90"):
        runner(packed)
    deep_gemm_standin.install(monkeypatch, arch=10)
    got = backend.combine_b(backend.combine_a(runner(packed), d.handle)).float()
    want = _fp8_reference(experts, DispatchFormat.MASKED, x, idx, w, ue8m0=True, rows=(q, s))
    assert torch.equal(got, want.float())
    assert torch.equal(run_experts(packed, experts.local(0, E)),
                       run_experts(DispatchOutput(d.format, q, d.tokens_per_expert, d.handle, scales=s),
                                   experts.local(0, E)))  # the plain runner unpacks them
