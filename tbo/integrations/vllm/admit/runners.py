"""Which of vLLM's model runners tbo drives, told apart where the weights load, and what each refuses by name.

vLLM builds its model runner in the worker: the V1 runner (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, the
CPU worker's ``cpu_model_runner.CPUModelRunner``) or Model Runner V2 (``vllm.v1.worker.gpu.model_runner.
GPUModelRunner``, its CPU subclass ``vllm.v1.worker.cpu.model_runner.CPUModelRunner``, the encoder-only
``mm_encoder_model_runner.MMEncoderModelRunner``). vLLM 0.32 and 0.33 pick V2 on every CUDA install with Triton
(``VllmConfig.use_v2_model_runner``); the plugin wraps ``load_model`` on every one of these classes
(`tbo.integrations.vllm.plugin.RUNNER_CLASSES`), so that an engine given tbo's config is never served by a runner tbo
does not drive: `runner_kind` names the runner, and a runner it does not know, or a V2 engine asking for what tbo does
not run on V2 yet (`check_v2`), is refused by name before the weights load, with the way out (the V1 runner,
``VLLM_USE_V2_MODEL_RUNNER=0``, where the release still has it).
"""

from __future__ import annotations

from typing import Any

from tbo.integrations.vllm.config import TboVllmConfig
from tbo.integrations.vllm.errors import TboConfigError, refuse

__all__ = ["REFUSED_RUNNER_CLASSES", "V1_RUNNER_CLASSES", "V2_RUNNER_CLASSES", "V2_WAY_OUT", "check_v2",
           "runner_kind"]

#: (module, class) of the V1 runners (the CPU one overrides ``load_model``)
V1_RUNNER_CLASSES = (("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
                     ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"))
#: (module, class) of Model Runner V2's runners: the GPU one (which defines ``load_model``) and its subclasses
V2_RUNNER_CLASSES = (("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
                     ("vllm.v1.worker.cpu.model_runner", "CPUModelRunner"),
                     ("vllm.v1.worker.mm_encoder_model_runner", "MMEncoderModelRunner"))
#: (module, class) of runners tbo does not drive, which the plugin wraps all the same so that `runner_kind` refuses an
#: engine given tbo's config on them by name: vLLM 0.34's V2 runner of the CPU worker on non-x86 CPUs without Triton
#: (``CpuPlatform.uses_standalone_cpu_model_runner``), not a V2 ``GPUModelRunner`` subclass, its own ``load_model``
REFUSED_RUNNER_CLASSES = (("vllm.v1.worker.cpu.standalone_model_runner", "StandaloneCPUModelRunner"),)
#: what a refused V2 engine is told to do instead
V2_WAY_OUT = ("run vLLM's V1 model runner instead (VLLM_USE_V2_MODEL_RUNNER=0, vLLM 0.32 and 0.33), or remove "
              "additional_config['tbo']")


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def runner_kind(runner: Any, vllm_version: str) -> str:
    """``"v1"`` or ``"v2"``: which of vLLM's model runners ``runner`` is (by its classes, the V2 ones checked first:
    none of them derives from V1's); a runner of neither is refused, naming its class and the version."""
    names = {_name(c) for c in type(runner).__mro__}
    if any(f"{m}.{c}" in names for m, c in V2_RUNNER_CLASSES):
        return "v2"
    if any(f"{m}.{c}" in names for m, c in V1_RUNNER_CLASSES):
        return "v1"
    raise TboConfigError(f"additional_config['tbo'] on vLLM {vllm_version}'s model runner {_name(type(runner))}: "
                         "not supported (tbo drives vLLM's V1 model runner and Model Runner V2, and this is neither); "
                         "remove additional_config['tbo']")


def check_v2(runner_cls: type, vllm_config: Any, config: TboVllmConfig, vllm_version: str) -> None:
    """Refuse, by name, what tbo does not run on Model Runner V2 yet (docs/vllm.md, "V1 and V2"): it runs eager steps
    of a MoE model on one rank, or of a dense or MoE model under tensor parallelism (every TP worker decides the same
    step alike from the same batch, its all-reduces tbo's transfers as on V1), split at any microbatch count by the
    config's thresholds or by the adaptive choice (``split: "adaptive"``, the TP workers exchanging their step times
    before each choice), over tbo's local backend, also over an emulated ``link`` (under TP it carries the
    all-reduces too), or with its FFN on an AFD server (``afd``). Everything else (data parallelism with expert
    parallelism, compiled mode and CUDA graphs, speculative decoding, DeepEP) runs on the V1 runner only.
    ``runner_cls``: the runner's class, as the refusal names it."""
    where = f"vLLM {vllm_version}'s Model Runner V2 ({_name(runner_cls)})"

    def no(setting: dict[str, Any], what: str) -> None:
        refuse(setting, f"the V1 runner; {V2_WAY_OUT}", f"{what} runs on vLLM's V1 model runner only; tbo does not "
               f"drive it on {where} yet")

    par, model = vllm_config.parallel_config, vllm_config.model_config
    if par.data_parallel_size != 1:
        no({"data_parallel_size": par.data_parallel_size}, "data parallelism (DP attention + EP, tbo's step agreement)")
    if not model.enforce_eager:
        no({"enforce_eager": False}, "compiled mode and CUDA graphs (CudaGraphManager)")
    if vllm_config.speculative_config is not None:
        no({"speculative_config": getattr(vllm_config.speculative_config, "method", "ON")},
           "speculative decoding (ngram, MTP)")
    if config.backend != "local":
        no({"backend": config.backend}, f"the {config.backend!r} backend")

