"""Dense models under tensor parallelism: does overlapping the all-reduce pay, and from how many tokens?

A dense layer at TP = n ends attention and its MLP with an all-reduce of ``tokens x hidden`` activations. Splitting
the step into two microbatches (``dense_tp_decode``/``dense_tp_prefill``) hides one microbatch's all-reduce behind
the other's compute, and pays for it twice over: every weight is read once per microbatch (decode is weight-bound:
its compute nearly doubles), and every all-reduce runs twice, on messages half the size. The second cost is where
the algorithm matters. All-reduce kernels switch algorithm by message size:

* **one-shot** (small messages): every rank reads every peer's whole buffer and sums: one step of latency, but
  ``(n - 1) x`` the message through each rank's link;
* **two-shot** (large ones): reduce-scatter, then all-gather: two steps of latency, ``2 (n - 1) / n x`` the message.

Below the kernel's cut-off the one-shot runs. At n = 4 it moves twice the bytes a two-shot would, so a step whose
whole message is above the cut-off but whose halves fall under it pays double the link time for its all-reduces
when split: RFC vllm#56126's trap (dense, 4 GPUs over PCIe: halves fell under the two-shot cut-off). The link
presets below carry the cut-offs of the kernels that run there (`TPLink.one_shot_max_bytes`); the all-reduce is a
`TransferCost` with ``seconds`` (a piecewise-linear `Cost`, exact on both sides of the cut-off), so `simulate`,
`compare` and the crossover scan see the trap as it is.

Compute is the same roofline as `tbo.tools.predict.costs` (its `Kernel`s), per GPU: each rank runs ``heads / n``
heads and ``intermediate / n`` columns. In prefill the two-shot's kernels hold ``comm_sms`` SMs while the
microbatches overlap (``dense_tp_prefill``'s budget), so the overlapped compute runs on the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field

from tbo.core.strategy import OperationsStrategy
from tbo.strategies.tensor_parallel import DENSE_TP_OPS
from tbo.tools.inputs import read_json
from tbo.tools.predict.costs import Kernel, _gemm, _op_cost, _pass
from tbo.tools.predict.hardware import DEFAULT_EFFICIENCY, TFLOPS, Efficiency, Hardware, HARDWARE
from tbo.tools.simulate import Comparison, Cost, CostModel, TransferCost, compare, simulate, split_tokens

__all__ = ["DenseShape", "DENSE_MODELS", "TPLink", "TP_LINKS", "TP_GPUS", "allreduce_seconds", "predict_tp",
           "TPPrediction", "get_dense_model", "get_tp_hardware"]

KiB = 1024


class DenseShape(BaseModel):
    """The cost-relevant shape of a dense decoder (GQA attention, SwiGLU MLP)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    num_layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate: int = Field(gt=0)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | Path, name: str | None = None) -> "DenseShape":
        """A shape from a dense model's Hugging Face ``config.json`` (a dict, a file or a model directory)."""
        if not isinstance(config, Mapping):
            path = Path(config)
            config = read_json(path / "config.json" if path.is_dir() else path, "model config")
        c = dict(config)
        try:
            heads = c["num_attention_heads"]
            return cls(name=name or c.get("_name_or_path") or c.get("model_type") or "hf-model",
                       num_layers=c["num_hidden_layers"], hidden=c["hidden_size"], num_heads=heads,
                       num_kv_heads=c.get("num_key_value_heads", heads),
                       head_dim=c.get("head_dim") or c["hidden_size"] // heads, intermediate=c["intermediate_size"])
        except KeyError as exc:
            raise ValueError(f"dense model config lacks key {exc.args[0]!r}") from None


DENSE_MODELS: dict[str, DenseShape] = {
    # Qwen/Qwen3-32B config.json: 64 layers, hidden 5120, 64 heads, 8 KV heads, head_dim 128, intermediate 25600
    "qwen3-32b": DenseShape(name="qwen3-32b", num_layers=64, hidden=5120, num_heads=64, num_kv_heads=8, head_dim=128,
                            intermediate=25600),
    # meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads, intermediate 14336
    "llama-3.1-8b": DenseShape(name="llama-3.1-8b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8,
                               head_dim=128, intermediate=14336),
    # meta-llama/Llama-3.1-70B config.json: 80 layers, hidden 8192, 64 heads, 8 KV heads, intermediate 28672
    "llama-3.1-70b": DenseShape(name="llama-3.1-70b", num_layers=80, hidden=8192, num_heads=64, num_kv_heads=8,
                                head_dim=128, intermediate=28672),
}


class TPLink(BaseModel):
    """The all-reduce's link and kernels: per-GPU bandwidth per direction (``bandwidth x efficiency`` achieved),
    the latency of one algorithm step, and the one-shot cut-off by group size (messages below it run one-shot;
    a size absent: two-shot only above 2 ranks, one-shot only at 2, as vLLM's custom all-reduce does)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    bandwidth: float = Field(gt=0, allow_inf_nan=False, description="bytes/s per GPU per direction")
    efficiency: float = Field(default=0.7, gt=0, le=1)
    step_latency_s: float = Field(ge=0, allow_inf_nan=False, description="one algorithm step (one-shot: 1, two-shot: 2)")
    one_shot_max_bytes: dict[int, float] = Field(default_factory=dict)
    comm_sms: int = Field(default=0, ge=0, description="SMs the all-reduce kernels hold while they run (prefill)")

    def one_shot(self, nbytes: float, tp: int) -> bool:
        if tp == 2:
            return nbytes < self.one_shot_max_bytes.get(2, float("inf"))
        return nbytes < self.one_shot_max_bytes.get(tp, 0.0)


#: vLLM's custom all-reduce (csrc/custom_all_reduce.cuh): one-shot ("1-stage") always at 2 GPUs, below 512 KiB at
#: up to 4, below 256 KiB at up to 8; two-shot ("2-stage") above. vLLM runs it over NVLink, or PCIe at 2 GPUs.
_CUSTOM_AR_ONE_SHOT = {4: 512 * KiB, 6: 256 * KiB, 8: 256 * KiB}

TP_LINKS: dict[str, TPLink] = {
    # NVSwitch, H100/H200 SXM: NVLink 900 GB/s both directions -> 450 per direction; the DeepEP-fitted NVLink
    # efficiency (0.7); a few microseconds per step (custom all-reduce's signal exchange and kernel)
    "nvlink": TPLink(name="nvlink", bandwidth=450e9, efficiency=0.7, step_latency_s=5e-6,
                     one_shot_max_bytes=_CUSTOM_AR_ONE_SHOT, comm_sms=16),
    # PCIe Gen4 x16 peer to peer through a switch: 32 GB/s per direction, ~70% reached; NCCL over PCIe pays
    # ~10-15 us per step. The one-shot cut-off is the same kernel's, as an assumption (see docs/predicting.md)
    "pcie4": TPLink(name="pcie4", bandwidth=32e9, efficiency=0.7, step_latency_s=12e-6,
                    one_shot_max_bytes=_CUSTOM_AR_ONE_SHOT, comm_sms=8),
    # PCIe Gen5 x16: 64 GB/s per direction
    "pcie5": TPLink(name="pcie5", bandwidth=64e9, efficiency=0.7, step_latency_s=10e-6,
                    one_shot_max_bytes=_CUSTOM_AR_ONE_SHOT, comm_sms=8),
}

#: PCIe cards (datasheets, dense peaks); their "nvlink" field is the PCIe peer-to-peer rate (unused here)
TP_GPUS: dict[str, Hardware] = {
    # NVIDIA L40S datasheet: BF16 362 TFLOPS dense (733 sparse), FP8 733 dense, 864 GB/s GDDR6, 142 SMs, 48 GB
    "l40s": Hardware(name="l40s", bf16_flops=362 * TFLOPS, fp8_flops=733 * TFLOPS, hbm_bandwidth=864e9, num_sms=142,
                     nvlink_bandwidth=32e9, nic_bandwidth=25e9, message_latency_s=0.0, memory_bytes=48e9,
                     gpus_per_node=4),
    # NVIDIA H100 PCIe datasheet: BF16 756 TFLOPS dense (1,513 sparse), FP8 1,513 dense, 2.0 TB/s, 114 SMs, 80 GB
    "h100-pcie": Hardware(name="h100-pcie", bf16_flops=756 * TFLOPS, fp8_flops=1513 * TFLOPS, hbm_bandwidth=2.0e12,
                          num_sms=114, nvlink_bandwidth=64e9, nic_bandwidth=50e9, message_latency_s=0.0,
                          memory_bytes=80e9, gpus_per_node=4),
}


def get_dense_model(name_or_path: str | DenseShape) -> DenseShape:
    if isinstance(name_or_path, DenseShape):
        return name_or_path
    if str(name_or_path).lower() in DENSE_MODELS:
        return DENSE_MODELS[str(name_or_path).lower()]
    path = Path(name_or_path)
    if path.is_file() or (path / "config.json").is_file():
        return DenseShape.from_hf_config(path, name=path.stem if path.is_file() else path.name)
    raise ValueError(f"unknown dense model {name_or_path!r}; known: {', '.join(sorted(DENSE_MODELS))} (or a "
                     "Hugging Face config.json)")


def get_tp_hardware(name: str | Hardware) -> Hardware:
    if isinstance(name, Hardware):
        return name
    key = str(name).lower()
    if key in TP_GPUS:
        return TP_GPUS[key]
    if key in HARDWARE:
        return HARDWARE[key]
    raise ValueError(f"unknown hardware {name!r}; known: {', '.join(sorted({*HARDWARE, *TP_GPUS}))}")


def allreduce_seconds(nbytes: float, tp: int, link: TPLink) -> tuple[float, str]:
    """(seconds, ``"one-shot"`` | ``"two-shot"``) of one all-reduce of ``nbytes`` over ``tp`` ranks."""
    if tp == 1 or nbytes <= 0:
        return 0.0, "none"
    rate = link.bandwidth * link.efficiency
    if link.one_shot(nbytes, tp):
        return link.step_latency_s + (tp - 1) * nbytes / rate, "one-shot"
    return 2 * link.step_latency_s + 2 * (tp - 1) / tp * nbytes / rate, "two-shot"


def _allreduce_cost(bytes_per_token: float, tp: int, link: TPLink, max_tokens: int) -> Cost:
    """`allreduce_seconds` by tokens as a table, exact on both sides of the cut-off (two points a token apart)."""
    marks = {0, 1, max_tokens}
    cut = link.one_shot_max_bytes.get(tp) if tp > 2 else link.one_shot_max_bytes.get(2)
    if cut is not None:
        below = int((cut - 1e-9) // bytes_per_token)
        marks.update(t for t in (below, below + 1) if 0 < t < max_tokens)
    return Cost(kind="table", points=[(float(t), allreduce_seconds(t * bytes_per_token, tp, link)[0])
                                      for t in sorted(marks)])


def dense_tp_kernels(shape: DenseShape, tp: int, mode: str, context: int, kv_bytes: float = 2.0,
                     weight_dtype: Literal["fp8", "bf16"] = "bf16") -> dict[str, list[Kernel]]:
    """The kernels behind every op of ``dense_tp_*`` on one GPU of ``tp``."""
    bad = [f"{n}={v}" for n, v in (("num_heads", shape.num_heads), ("intermediate", shape.intermediate)) if v % tp]
    if bad:
        raise ValueError(f"{shape.name} at TP {tp}: {', '.join(bad)} not divisible by {tp}")
    h, d, w, dt = shape.hidden, shape.head_dim, (1.0 if weight_dtype == "fp8" else 2.0), weight_dtype
    heads, kv = shape.num_heads // tp, max(shape.num_kv_heads // tp, 1)
    inter = shape.intermediate // tp
    decode = mode == "decode"
    seen = context if decode else (context + 1) / 2
    attn = (Kernel("gqa_decode", flops_per_token=4.0 * heads * seen * d, bytes_per_token=seen * 2 * kv * d * kv_bytes,
                   attention=True) if decode else
            Kernel("gqa_prefill", flops_per_token=4.0 * heads * seen * d, bytes_per_token=2.0 * (2 * heads + 2 * kv) * d,
                   attention=True))
    return {
        "comm_prepare_attn": [_pass("input_norm", 4.0 * h)],
        "attn_prepare": [_gemm("qkv_proj", h, (heads + 2 * kv) * d, dt, w), _pass("qk_norm_rope", 4.0 * (heads + kv) * d)],
        "attn_core": [attn, _gemm("o_proj", heads * d, h, dt, w)],
        "attn_reduce_a": [], "attn_reduce_b": [],
        "comm_prepare_mlp": [_pass("residual_norm", 6.0 * h)],
        "mlp": [_gemm("mlp_gate_up", h, 2 * inter, dt, w), _pass("mlp_act", 5.0 * inter),
                _gemm("mlp_down", inter, h, dt, w)],
        "mlp_reduce_a": [], "mlp_reduce_b": [],
        "output": [_pass("add_residual", 6.0 * h)],
        "comm_postprocess_layer": [],
    }


@dataclass(frozen=True)
class TPPrediction:
    """Predicted costs of a dense model's step at TP = ``tp``: `compare` at any token count, `crossover`."""

    hardware: Hardware
    model: DenseShape
    link: TPLink
    tp: int
    mode: str
    context: int
    strategy: OperationsStrategy
    costs: CostModel

    def compare(self, tokens: int) -> Comparison:
        """Single batch vs two microbatches of ``tokens`` in all, every layer simulated (with traces)."""
        return compare(self.strategy, self.costs, tokens)

    def steps(self, tokens: int) -> tuple[float, float]:
        """(single-batch, TBO) step seconds at ``tokens``, from two- and three-layer runs: every layer is alike
        and the schedule periodic, so the step grows by the same time per layer (exact to rounding, and a
        scan over token counts stays fast)."""
        layer = OperationsStrategy(operations=list(DENSE_TP_OPS), delta_stages=0)
        out = []
        for parts in ([tokens], split_tokens(tokens)):
            two, three = (simulate(OperationsStrategy.concat([layer] * n), self.costs, parts).step_s for n in (2, 3))
            out.append(two + (self.model.num_layers - 2) * (three - two))
        return out[0], out[1]

    def speedup(self, tokens: int) -> float:
        single, tbo = self.steps(tokens)
        return single / tbo if tbo > 0 else 1.0

    def allreduce(self, tokens: int) -> tuple[float, str]:
        """(seconds, algorithm) of one all-reduce of ``tokens`` rows."""
        return allreduce_seconds(tokens * self.model.hidden * 2.0, self.tp, self.link)

    def crossover(self, tokens: range | list[int] | None = None, min_gain: float = 1.0) -> int | None:
        """The fewest tokens from which splitting pays at every count scanned above it (a scan, not a bisection:
        the cut-off makes the gain non-monotonic); None when it never does in the range."""
        grid = list(tokens if tokens is not None else range(2, 2049, 2))
        pays = [self.speedup(n) > min_gain for n in grid]
        if not pays[-1]:
            return None
        i = len(grid) - 1
        while i > 0 and pays[i - 1]:
            i -= 1
        return grid[i]


def predict_tp(hardware: str | Hardware, model: str | DenseShape, *, tp: int, link: str | TPLink = "nvlink",
               mode: Literal["decode", "prefill"] = "decode", context: int = 1024, kv_bytes: float = 2.0,
               weight_dtype: Literal["fp8", "bf16"] = "bf16", efficiency: Efficiency = DEFAULT_EFFICIENCY,
               max_tokens: int = 1 << 16) -> TPPrediction:
    """The cost model of ``model`` on ``tp`` GPUs of ``hardware`` joined by ``link`` (`TP_LINKS`), on the
    ``dense_tp_decode``/``dense_tp_prefill`` list of every layer."""
    if tp < 2:
        raise ValueError(f"tp={tp}: tensor parallelism needs 2 GPUs or more (at 1 there is no all-reduce)")
    hw, shape = get_tp_hardware(hardware), get_dense_model(model)
    link = TP_LINKS[link] if isinstance(link, str) and link in TP_LINKS else link
    if not isinstance(link, TPLink):
        raise ValueError(f"unknown link {link!r}; known: {', '.join(TP_LINKS)}")
    kernels = dense_tp_kernels(shape, tp, mode, context, kv_bytes, weight_dtype)
    ops = {name: _op_cost(ks, hw, efficiency) for name, ks in kernels.items()}
    overlapped = {}
    if mode == "prefill" and link.comm_sms:  # the two-shot kernels hold SMs while the other microbatch computes
        fraction = (hw.num_sms - link.comm_sms) / hw.num_sms
        overlapped = {name: (c, c) for name, c in ((n, _op_cost(ks, hw, efficiency, fraction))
                                                   for n, ks in kernels.items())}
    per_token = shape.hidden * 2.0  # BF16 activations
    reduce = TransferCost(bytes_per_token=per_token * 2 * (tp - 1) / tp,
                          seconds=_allreduce_cost(per_token, tp, link, max_tokens))
    costs = CostModel(ops=ops, transfers={"attn_reduce": reduce, "mlp_reduce": reduce}, overlapped=overlapped)
    layer = OperationsStrategy(operations=list(DENSE_TP_OPS), delta_stages=0, name=f"dense_tp_{mode}")
    whole = OperationsStrategy.concat([layer] * shape.num_layers, name=f"{shape.name}_dense_tp_{mode}")
    return TPPrediction(hw, shape, link, tp, mode, context, whole, costs)
