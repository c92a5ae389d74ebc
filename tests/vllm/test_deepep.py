"""DeepEP low-latency decode in the vLLM plugin (issue 37, item 4), on the CPU stand-in of ``deep_ep.Buffer``.

Two gloo ranks each build vLLM's own Qwen3-MoE (bf16, hidden 2048: a size DeepEP's low-latency kernels are compiled
for) with data parallel 2 + expert parallel, four of the eight experts each, exactly as an engine's worker builds it
(vLLM's config, its distributed groups over gloo, its model loader). The plugin's own `make_backend` builds DeepEP
over vLLM's expert-parallel group with the stand-in module: low-latency (MASKED) for decode, normal (NORMAL) for
prefill, behind one `ModeBackends`. The layer's MoE ops run both ways on each rank's tokens, microbatch after
microbatch, and the outputs are compared:

* the MASKED path (low-latency dispatch, vLLM's experts kernel on the slabs: the conversion vLLM's CPU kernel needs,
  `tbo.integrations.vllm.model.masked`, low-latency combine) equals **exactly** tbo's one-process MASKED path over every
  expert (the same layer op over `LocalBackend` MASKED with the same slab capacity): the same rows at the same slab
  positions through the same kernel, the same float32 weighted reduction;
* both agree with vLLM's own fused-MoE forward of the layer (one process, every expert) to bf16 rounding, and so
  does the NORMAL path over DeepEP normal mode: a wrong expert, weight or slab row would be off by far more;
* the decode strategy is bound against the low-latency backend's one-un-received-call rule (and the prefill
  strategy, lead 0, is refused over it), every receive hook was called, and the MASKED kernel ran (counted).

Low-latency mode carries BF16 only (DeepEP's contract), so this path has no float32 run to compare exactly.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed (make test-vllm runs this)")]

HIDDEN, EXPERTS, TOP_K = 2048, 8, 2
#: rows per microbatch on each rank: uneven, a rank with an empty microbatch, a microbatch of one token
ROWS = {0: (3, 2), 1: (1, 0)}
MAX_DECODE = 16  # max_num_seqs: the low-latency buffers' tokens per rank


def _save(path: Path) -> Path:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=16, num_key_value_heads=2, head_dim=128, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, max_position_embeddings=512, initializer_range=0.05)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("deepep") / "qwen3_moe_2048")


def _vllm_layer(path: str, rank: int, world: int):
    """vLLM's decoder layer 0, built as an engine's worker builds it, this process being DP rank ``rank`` of
    ``world`` (expert parallel over them when ``world`` > 1)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    dp = dict(data_parallel_size=world, data_parallel_rank=rank, enable_expert_parallel=True) if world > 1 else {}
    config = EngineArgs(model=path, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
                        distributed_executor_backend="external_launcher", max_model_len=256,
                        max_num_seqs=MAX_DECODE, **dp).create_engine_config()
    _set_torch_accelerator_to_noop()  # what vLLM's CPU model runner does before it loads a model
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1, backend="gloo")
        model = get_model(vllm_config=config)
    torch.manual_seed(1234)
    return config, model.model.layers[0]


def _inputs(seed: int):
    """Each microbatch's global rows (rank 0's first, then rank 1's), bf16, wide enough to route over experts."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn(ROWS[0][mb] + ROWS[1][mb], HIDDEN, generator=g).to(torch.bfloat16) for mb in range(2)]


def _moe(layer, x, mode=None):
    """The layer's MoE ops on one microbatch's rows ``x``: router, dispatch, experts, combine, output."""
    from tbo.core.state import State
    from tbo.integrations.vllm.comm.backend import select_backend

    if mode is not None:
        select_backend(layer.backend, mode)
    state = State()
    state.mlp_in = x
    for op in (layer.op_gate, layer.op_select_experts, layer.op_dispatch_a, layer.op_dispatch_b, layer.op_experts,
               layer.op_combine_a, layer.op_combine_b, layer.op_output):
        op(state)
    return state.pop("layer_out")


def _rank(rank: int, world: int, path: str, seed: int) -> dict:
    import torch

    import tbo.strategies as S
    from tbo.core.errors import StrategyError
    from tbo.integrations.vllm.comm.backend import ModeBackends, make_backend
    from tbo.integrations.vllm.config import TboConfigError, parse_config
    from tbo.integrations.vllm.model.ep_layer import EpDecoderLayer
    from tbo.integrations.vllm.comm.ep import expert_parallel_size
    from tbo.integrations.engine.stats import StepStats
    from tbo.testing import deepep_standin

    _, layer = _vllm_layer(path, rank, world)
    assert expert_parallel_size() == world
    config = parse_config({"tbo": {"backend": "deepep", "deepep_decode": "low_latency", "comm_timeout_s": 60}})
    backend = make_backend(config, EXPERTS, hidden=HIDDEN, top_k=TOP_K, max_tokens=64, ep_size=world, platform="cpu",
                           dtype=torch.bfloat16, max_decode_tokens=MAX_DECODE, deep_ep=deepep_standin)
    assert isinstance(backend, ModeBackends), backend
    # a float32 model: low-latency mode carries bf16 only; "auto" keeps normal mode, "low_latency" is refused
    fp32 = dict(hidden=HIDDEN, top_k=TOP_K, max_tokens=64, ep_size=world, platform="cpu", dtype=torch.float32,
                max_decode_tokens=MAX_DECODE, deep_ep=deepep_standin)
    auto = make_backend(parse_config({"tbo": {"backend": "deepep"}}), EXPERTS, **fp32)
    assert not isinstance(auto, ModeBackends) and auto.format.name == "NORMAL", auto
    try:
        make_backend(config, EXPERTS, **fp32)
        fp32_refusal = ""
    except TboConfigError as e:
        fp32_refusal = str(e)
    # FP8 dispatch: normal mode carries the rows the quant method quantised; low-latency mode quantises in its kernel
    bf16 = {**fp32, "dtype": torch.bfloat16, "fp8": True}
    fp8_auto = make_backend(parse_config({"tbo": {"backend": "deepep"}}), EXPERTS, **bf16)
    assert not isinstance(fp8_auto, ModeBackends) and fp8_auto.carries_fp8, fp8_auto
    try:
        make_backend(config, EXPERTS, **bf16)
        fp8_refusal = ""
    except TboConfigError as e:
        fp8_refusal = str(e)
    ep = EpDecoderLayer(layer, backend, 0, 1)
    ep.counters = (StepStats(),)
    # the one-un-received-call rule on the schedule: the decode strategy binds over low-latency, prefill's does not
    S.bind_layers([ep], S.get("qwen3_moe_decode"), backend=backend.for_mode("decode"))
    try:
        S.bind_layers([ep], S.get("qwen3_moe_prefill"), backend=backend.for_mode("decode"))
        refused = ""
    except StrategyError as e:
        refused = str(e)
    lo = [sum(ROWS[r][mb] for r in range(rank)) for mb in range(2)]
    mine = [x[lo[mb]:lo[mb] + ROWS[rank][mb]] for mb, x in enumerate(_inputs(seed))]
    masked = [_moe(ep, x, "decode") for x in mine]
    normal = [_moe(ep, x, "prefill") for x in mine]
    return {"masked": masked, "normal": normal, "refused": refused, "ffn_calls": ep.counters[0].local_ffn_calls,
            "fp32_refusal": fp32_refusal, "fp8_refusal": fp8_refusal,
            "kernel": type(ep._masked).__name__, "pending": backend.decode.buffer.pending_hooks(),
            "ll_calls": backend.decode.buffer._calls.seq, "capacity": backend.decode.max_tokens * world}


def _reference(rank: int, world: int, path: str, seed: int, capacity: int) -> dict:
    """One process, every expert: tbo's MASKED path over `LocalBackend` (the same slab capacity), and vLLM's own
    fused-MoE forward of the layer."""
    from tbo.comm import DispatchFormat, LocalBackend
    from tbo.integrations.vllm.model.layers import VllmDecoderLayer

    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    config, layer = _vllm_layer(path, 0, 1)
    ref = VllmDecoderLayer(layer, LocalBackend(EXPERTS, DispatchFormat.MASKED, masked_capacity=capacity), 0, 1)
    xs = _inputs(seed)
    with set_current_vllm_config(config), set_forward_context(None, config):  # vLLM's MoE finds itself there
        vllm = [layer.mlp(x) for x in xs]
    return {"masked": [_moe(ref, x) for x in xs], "vllm": vllm}


def test_low_latency_decode_equals_tbos_one_process_masked_path_and_vllm_on_the_standin(model):
    import torch

    from tbo.harness.launch import launch

    seed = 5
    per_rank = launch(_rank, 2, str(model), seed, timeout_s=600)
    capacity = per_rank[0]["capacity"]
    assert capacity == 16 * 2  # max_num_seqs per rank, both ranks' rows in each expert's slab
    ref = launch(_reference, 1, str(model), seed, capacity, timeout_s=600)[0]
    for r in range(2):
        got = per_rank[r]
        assert got["kernel"] == "MaskedExperts" and got["pending"] == [], got
        assert got["ll_calls"] >= 4, got  # a low-latency dispatch and combine per microbatch
        assert got["ffn_calls"] == 4, got  # the experts ran on both microbatches, both ways
        assert "DeepEP low-latency" in got["refused"], got["refused"]
        assert "deepep_decode='low_latency': DeepEP's low-latency kernels cannot carry this model's decode steps " \
               "(its dispatch takes bfloat16 hidden states and this model runs in torch.float32)" in \
               got["fp32_refusal"], got["fp32_refusal"]
        assert "deepep_decode='low_latency': DeepEP's low-latency kernels cannot carry this model's decode steps " \
               "(FP8 dispatch (fp8_dispatch)" in got["fp8_refusal"], got["fp8_refusal"]
    for mb in range(2):
        masked = torch.cat([per_rank[r]["masked"][mb] for r in range(2)])
        normal = torch.cat([per_rank[r]["normal"][mb] for r in range(2)])
        assert masked.dtype == torch.bfloat16 and masked.shape == ref["masked"][mb].shape
        assert torch.equal(masked, ref["masked"][mb]), f"microbatch {mb}: low-latency differs from one process"
        vllm = ref["vllm"][mb].float()
        scale = vllm.abs().max().item()
        assert scale > 0
        for name, out in (("masked", masked), ("normal", normal)):
            err = (out.float() - vllm).abs().max().item()
            assert err <= 2e-2 * scale, f"microbatch {mb}: the {name} path is {err} off vLLM's (scale {scale})"


def test_low_latency_sizing_and_refusals_name_the_culprit():
    import torch

    from tbo.integrations.vllm.comm.backend import low_latency_refusal, low_latency_tokens

    assert [low_latency_tokens(n, 2) for n in (1, 2, 3, 16)] == [2, 2, 4, 16]
    assert low_latency_tokens(5, 4) == 5 and low_latency_tokens(5, 1) == 8
    ok = dict(dtype=torch.bfloat16, hidden=2048, top_k=8, num_ranks=8, max_decode_tokens=256)
    assert low_latency_refusal(**ok) is None
    assert "takes bfloat16" in low_latency_refusal(**{**ok, "dtype": torch.float32})
    assert "hidden=1024: DeepEP's low-latency kernels are compiled for hidden sizes 2048" in \
        low_latency_refusal(**{**ok, "hidden": 1024})
    assert "top-k 12" in low_latency_refusal(**{**ok, "top_k": 12})
    assert "NVSHMEM_QP_DEPTH" in low_latency_refusal(**{**ok, "max_decode_tokens": 600})


def test_mode_backends_route_each_step_to_its_kind():
    from tbo.comm import DispatchFormat, LocalBackend
    from tbo.integrations.vllm.comm.backend import ModeBackends, select_backend

    decode, prefill = LocalBackend(8, DispatchFormat.MASKED, masked_capacity=4), LocalBackend(8, DispatchFormat.NORMAL)
    both = ModeBackends(decode, prefill)
    assert select_backend(both, "decode") is decode and both.format is DispatchFormat.MASKED
    assert select_backend(both, "prefill") is prefill and both.format is DispatchFormat.NORMAL
    assert select_backend(prefill, "decode") is prefill  # one backend: every step's
    with pytest.raises(ValueError, match="differ in num_experts: 8 != 4"):
        ModeBackends(decode, LocalBackend(4, DispatchFormat.NORMAL))
