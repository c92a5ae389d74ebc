"""What the plugin supports, checked against the engine's configuration before the weights load.

Each check names the setting and what is accepted, so that an engine tbo cannot run fails at start instead of
running without TBO or running wrong. The table here is the one `docs/vllm.md` prints.
"""

from __future__ import annotations

import re
from typing import Any

from tbo.integrations.vllm.config import TboVllmConfig
from tbo.integrations.vllm.contract import RUNNERS
from tbo.integrations.vllm.errors import TboConfigError, refuse

__all__ = ["SUPPORTED_VLLM", "check_engine", "check_quantization", "check_vllm_version", "family_of"]

#: the vLLM versions the plugin admits: the releases of `RUNNERS` (``tbo.integrations.vllm.contract``: what tbo uses
#: in each, checked on each release's source by ``make contract``)
SUPPORTED_VLLM = ">=0.32.0,<0.35"
_RUNNER_NAMES = {"v1": "V1", "v2": "V2 (Model Runner V2)"}


def _supported() -> str:
    """The admitted releases and their runners, for messages: ``0.32 (V1, V2), 0.33 (V1, V2), 0.34 (V2)``."""
    return ", ".join(f"{r} ({', '.join(x.upper() for x in runners)})" for r, runners in RUNNERS.items())


def check_vllm_version(version: str, runner: str | None = None) -> tuple[str, ...]:
    """Refuse a vLLM outside `SUPPORTED_VLLM`, naming it and the supported range: the plugin reaches into vLLM's model
    runners and model layers, which change between releases. With ``runner`` (``"v1"`` or ``"v2"``), also refuse a
    release that does not have that model runner (V1 on 0.34). Returns the runners the release has. (A version that
    does not parse, a source build, is let through, with both runners.)"""
    if runner is not None and runner not in _RUNNER_NAMES:
        raise ValueError(f"runner {runner!r} is not one of {', '.join(_RUNNER_NAMES)}")
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        return tuple(_RUNNER_NAMES)
    release = f"{int(m[1])}.{int(m[2])}"
    if release not in RUNNERS:
        raise TboConfigError(f"tbo's vLLM plugin supports vLLM {SUPPORTED_VLLM} ({_supported()}), but {version} is "
                             "installed: remove additional_config['tbo'] or install a supported vLLM")
    runners = RUNNERS[release]
    if runner is not None and runner not in runners:
        raise TboConfigError(f"vLLM {version} has no {_RUNNER_NAMES[runner]} model runner (it has "
                             f"{', '.join(_RUNNER_NAMES[x] for x in runners)}); tbo's vLLM plugin supports "
                             f"{_supported()}: remove additional_config['tbo'] or install a vLLM with that runner")
    return runners


def family_of(architectures: Any) -> str:
    """The model's architecture, as its messages name it. No architecture is refused by name: which decoder layers
    tbo runs is decided by their structure when the model loads (`tbo.integrations.vllm.model.structure`)."""
    archs = list(architectures or [])
    if not archs:
        raise TboConfigError("the model's config names no architecture; tbo's vLLM plugin needs one to load it")
    return str(archs[0])


def _check_compiled(vllm_config: Any, config: TboVllmConfig) -> None:
    """A compiled engine (``enforce_eager=False``, `tbo.integrations.vllm.runner.forwards`): what is accepted today.

    Data parallelism is, without CUDA graphs (``cudagraph_mode`` NONE; `tbo.integrations.vllm.step.graphs` refuses a
    FULL mode with it): vLLM 0.32 then pads a DP step only when its own microbatching (DBO) runs
    (``vllm/v1/worker/dp_utils.py``, ``_synchronize_dp_ranks``: ``should_dp_pad = synced_cudagraph_mode != 0 or
    should_ubatch``), and tbo's agreement answers that coordination with each rank's own token count
    (`tbo.integrations.vllm.step.agree.StepAgreementHook.coordinate`), as in an eager engine."""
    from tbo.integrations.vllm.admit.graphs import check_cudagraph_mode

    check_cudagraph_mode(vllm_config, config)  # FULL graphs of split decode steps; PIECEWISE alone refused
    if config.afd is not None:
        refuse({"enforce_eager": False}, "True with afd", "attention-FFN disaggregation runs eager only")
    if vllm_config.speculative_config is not None:
        refuse({"enforce_eager": False}, "True with speculative_config", "split verify steps are tested eager only (docs/vllm.md, speculative decoding)")


def check_engine(vllm_config: Any, config: TboVllmConfig, vllm_version: str, platform: str) -> str:
    """Check the engine ``vllm_config`` can run with ``config``; returns the model's architecture (its layers are
    admitted by their structure when it loads: `tbo.integrations.vllm.model.structure`).

    ``platform`` is vLLM's device type (``"cpu"``, ``"cuda"``, ...).
    """
    check_vllm_version(vllm_version)
    model = vllm_config.model_config
    architecture = family_of(getattr(model.hf_config, "architectures", None))
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size != 1:
        refuse({"pipeline_parallel_size": par.pipeline_parallel_size}, "1", "tbo runs the whole layer stack of one rank as one overlapped loop")
    if par.data_parallel_size != 1 or par.enable_expert_parallel:
        from tbo.integrations.vllm.admit.parallel import check_dp_ep

        check_dp_ep(par)
    if par.enable_dbo or par.ubatch_size > 1:
        refuse({"enable_dbo/ubatch_size": (par.enable_dbo, par.ubatch_size)}, "enable_dbo=False, ubatch_size 0", "vLLM's DBO and tbo both split the step; choose one")
    if par.enable_eplb:
        refuse({"enable_eplb": True}, "False", "EPLB's expert remapping is not wired into tbo's dispatch")
    if getattr(par, "decode_context_parallel_size", 1) != 1 or getattr(par, "prefill_context_parallel_size", 1) != 1:
        refuse({"decode/prefill_context_parallel_size": (par.decode_context_parallel_size,
                                                         par.prefill_context_parallel_size)}, "1, 1", "context parallelism splits attention differently")
    if not model.enforce_eager:  # compiled: vLLM's graph for unsplit steps, tbo's loop for split ones
        _check_compiled(vllm_config, config)
    if vllm_config.speculative_config is not None:
        from tbo.integrations.vllm.admit.speculative import check_speculative

        check_speculative(vllm_config.speculative_config, par, afd=config.afd is not None)
    if vllm_config.lora_config is not None:
        refuse({"lora": "enabled"}, "no LoRA", "LoRA's per-request adapters are not split per microbatch")
    # a quantized checkpoint is admitted by its layers' quant methods when it loads (quant.kernel_problems)
    check_quantization(getattr(model, "quantization", None), config)
    if config.backend == "deepep" and par.tensor_parallel_size > 1:
        refuse({"backend": "deepep"}, "'local' with tensor_parallel_size > 1", f"vLLM's expert-parallel group spans the {par.tensor_parallel_size} TP ranks of a MoE model even "
                "without enable_expert_parallel, so every token would be dispatched once per TP rank and each rank's "
                "local expert ids read as global ones")
    if config.backend == "deepep" and platform != "cuda":
        refuse({"backend": "deepep"}, "'local' on this platform", f"DeepEP needs CUDA GPUs; this is {platform}")
    if config.afd is not None:
        from tbo.integrations.vllm.afd.config import check_afd_engine

        check_afd_engine(vllm_config, config)
    return architecture


def check_quantization(quantization: str | None, config: Any) -> None:
    """At engine start: what the configuration alone says cannot run (``quantization``: vLLM's
    ``model_config.quantization``; ``config``: the `TboVllmConfig`). A quantized checkpoint is otherwise admitted;
    its layers' quant methods are checked when the model loads (`kernel_problems`)."""
    if config.fp8_dispatch is True and config.backend != "deepep":
        refuse({"fp8_dispatch": True, "backend": config.backend}, "backend 'deepep', or fp8_dispatch 'auto' / False",
               "tbo's own all-to-all moves one tensor per token and no scales; FP8 rows with their scales travel "
               "over DeepEP only")
    if config.fp8_dispatch is True and not quantization:
        refuse({"fp8_dispatch": True}, "a block-FP8 checkpoint (weight_block_size [128, 128]), or fp8_dispatch "
               "'auto' / False", "the checkpoint is not quantized: its experts take unquantised rows")
