"""Per-op costs by roofline, as the simulator's `CostModel`, for the built-in DeepSeek and Qwen3-MoE strategies.

Each op of a layer is a short list of kernels. A kernel costs ``launch + max(FLOPs / (peak * MFU), bytes / (HBM *
efficiency))``, with FLOPs and bytes a fixed part (weights, read once per call) plus a part per token: so splitting a
batch reads every weight twice, which is what TBO pays. Summed over kernels an op's cost is piecewise linear in its
microbatch's tokens; it is stored as a ``table`` `Cost` at its breakpoints, which the simulator interpolates exactly.
Dispatch and combine are transfers on one link (the bottleneck one) with DeepEP's latency (see `comm`). In prefill
the normal and V2 kernels hold ``comm_sms`` SMs while microbatches overlap: the overlapped costs run compute on the
rest, the SMs the prefill strategy's ``deep_gemm_num_sms`` leaves to DeepGEMM. SMs beyond that, accounted here:

* V2's copy (dispatch) and reduce (combine) epilogues run on **every** SM, so the receive-side passes are the
  transfers' ``epilogues``, device-wide compute at the wait, not ops that share the GPU with the other microbatch;
* V2 on one rank takes every SM (``get_theoretical_num_sms``'s no-traffic case): nothing runs beside its kernels, so
  the whole transfer is an epilogue and DeepGEMM gets no budget;
* V1 normal's buffers are sized for the ``Buffer.num_sms`` in effect when they are made: a ``comm_sms`` other than
  the default 20 comes with the note to set it before building them (`Prediction.notes`).

Everything runs through the existing `simulate`/`compare`/`recommend`/`find_threshold` on the real strategies
(``deepseek_decode``/``deepseek_prefill``, or the Qwen3-MoE ones for models without a shared expert), so a prediction
is read, exported and acted on like a measured cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tbo.core.strategy import OperationsStrategy
from tbo.split import SplitPolicy
from tbo.strategies import DENSE_OPS, deepseek_decode, deepseek_prefill, qwen3_moe_decode, qwen3_moe_prefill
from tbo.tools.simulate import (Comparison, Cost, CostModel, Recommendation, TransferCost, compare, find_threshold,
                                recommend)
from tbo.tools.predict.comm import Traffic, traffic
from tbo.tools.predict.hardware import DEFAULT_EFFICIENCY, Efficiency, Hardware, get_hardware
from tbo.tools.predict.memory import MemoryUse, memory_use
from tbo.tools.predict.model import Deployment, ModelShape, get_model

__all__ = ["Kernel", "Prediction", "predict", "layer_kernels", "split_policy"]


@dataclass(frozen=True)
class Kernel:
    """One kernel's work for a call on ``t`` tokens: ``flops_per_token * t`` FLOPs and ``bytes_fixed +
    bytes_per_token * t`` bytes of HBM traffic, on the ``dtype`` tensor cores (``attention`` kernels reach
    ``attention_mfu``, GEMMs ``gemm_mfu``)."""

    name: str
    flops_per_token: float = 0.0
    bytes_fixed: float = 0.0
    bytes_per_token: float = 0.0
    dtype: Literal["fp8", "bf16"] = "bf16"
    attention: bool = False

    def seconds(self, tokens: float, hw: Hardware, eff: Efficiency, sm_fraction: float = 1.0) -> float:
        mfu = eff.attention_mfu if self.attention else eff.gemm_mfu
        compute = self.flops_per_token * tokens / (hw.peak_flops(self.dtype) * mfu * sm_fraction)
        memory = (self.bytes_fixed + self.bytes_per_token * tokens) / (hw.hbm_bandwidth * eff.hbm_efficiency)
        return eff.kernel_overhead_s + max(compute, memory)

    def breakpoint(self, hw: Hardware, eff: Efficiency, sm_fraction: float = 1.0) -> float | None:
        """The token count where the kernel turns from memory- to compute-bound (None if it never does)."""
        mfu = eff.attention_mfu if self.attention else eff.gemm_mfu
        a = self.flops_per_token / (hw.peak_flops(self.dtype) * mfu * sm_fraction)
        b = self.bytes_per_token / (hw.hbm_bandwidth * eff.hbm_efficiency)
        if a <= b:
            return None
        return self.bytes_fixed / (hw.hbm_bandwidth * eff.hbm_efficiency) / (a - b)


def _gemm(name: str, k: int, n: int, dtype: str, weight_bytes: float, rows: float = 1.0,
          experts: int = 1) -> Kernel:
    """``rows`` activation rows per token of a (K x N) GEMM, over ``experts`` weight matrices (grouped GEMM)."""
    return Kernel(name, flops_per_token=2.0 * k * n * rows, bytes_fixed=float(k) * n * weight_bytes * experts,
                  bytes_per_token=rows * (k + 2.0 * n), dtype=dtype)  # type: ignore[arg-type]


def _pass(name: str, bytes_per_token: float) -> Kernel:
    """An elementwise kernel (norm, activation, copy): memory-bound."""
    return Kernel(name, bytes_per_token=bytes_per_token)


def layer_kernels(model: ModelShape, dep: Deployment, hw: Hardware) -> dict[str, list[Kernel]]:
    """The kernels behind every op of a MoE layer and of a dense one (op ``mlp``), per GPU.

    Decode MLA runs absorbed (attention over the 512+64 latent cache, ``w_kc``/``w_vc`` as BF16 batched GEMMs);
    prefill MLA expands K and V with ``kv_b``. Expert work is the busiest GPU's: ``topk / balancedness`` routed
    tokens per token it sends, over its ``expert_slots / ep`` experts, all of whose weights it reads.
    """
    h, w = model.hidden, (1.0 if dep.weight_dtype == "fp8" else 2.0)
    dt, ctx, decode = dep.weight_dtype, dep.context, dep.mode == "decode"
    ctx_seen = ctx if decode else (ctx + 1) / 2  # causal prefill: a prompt token sees half its prompt on average
    H = model.num_heads
    ops: dict[str, list[Kernel]] = {}
    ops["comm_prepare_attn"] = [_pass("input_norm", 4.0 * h)]
    if model.attention == "mla":
        nope, rope, v, kl, ql = (model.qk_nope_dim, model.qk_rope_dim, model.v_head_dim, model.kv_lora_rank,
                                 model.q_lora_rank)
        prep = [_gemm("qkv_a_proj", h, (ql or 0) + kl + rope, dt, w)]
        prep.append(_pass("q_kv_norm", 4.0 * ((ql or 0) + kl)))
        prep.append(_gemm("q_b_proj", ql or h, H * (nope + rope), dt, w))
        if decode:  # absorb W_UK into the query: a BF16 batched GEMM per head
            prep.append(_gemm("w_kc_bmm", nope, kl, "bf16", 2.0, rows=H, experts=H))
        else:       # expand the latent to per-head K and V
            prep.append(_gemm("kv_b_proj", kl, H * (nope + v), dt, w))
        prep.append(_pass("rope", 4.0 * H * rope))
        ops["attn_prepare"] = prep
        if decode:
            attn = Kernel("mla_decode", flops_per_token=2.0 * H * ctx * (kl + rope) + 2.0 * H * ctx * kl,
                          bytes_per_token=ctx * (kl + rope) * dep.kv_bytes, attention=True)
            core = [attn, _gemm("w_vc_bmm", kl, v, "bf16", 2.0, rows=H, experts=H)]
        else:
            attn = Kernel("mla_prefill", flops_per_token=2.0 * H * ctx_seen * (nope + rope + v),
                          bytes_per_token=2.0 * H * (2 * (nope + rope) + 2 * v), attention=True)
            core = [attn]
        core.append(_gemm("o_proj", H * v, h, dt, w))
        ops["attn_core"] = core
    else:
        d, kv = model.head_dim, model.num_kv_heads
        ops["attn_prepare"] = [_gemm("qkv_proj", h, (H + 2 * kv) * d, dt, w),
                               _pass("qk_norm_rope", 4.0 * (H + kv) * d)]
        if decode:
            attn = Kernel("gqa_decode", flops_per_token=4.0 * H * ctx * d,
                          bytes_per_token=ctx * 2 * kv * d * dep.kv_bytes, attention=True)
        else:
            attn = Kernel("gqa_prefill", flops_per_token=4.0 * H * ctx_seen * d,
                          bytes_per_token=2.0 * (2 * H + 2 * kv) * d, attention=True)
        ops["attn_core"] = [attn, _gemm("o_proj", H * d, h, dt, w)]
    ops["comm_prepare_mlp"] = [_pass("residual_norm", 6.0 * h)]
    ops["gate"] = [_gemm("router", h, model.num_experts, "bf16", 2.0)]
    ops["select_experts"] = [_pass("topk", 8.0 * model.num_experts)]
    skew = 1.0 / dep.balancedness
    pairs = model.topk * skew  # routed tokens the busiest GPU receives per token a GPU sends
    msg_in = h + h / 128 * 4 if dep.dispatch_dtype == "fp8" else 2.0 * h
    ops["dispatch_a"] = [_pass("quantize_send", 3.0 * h)]          # read BF16, write the FP8 message
    ops["dispatch_b"] = [_pass("unpack_recv", 2.0 * pairs * msg_in)]  # received messages into the expert layout
    local = dep.slots(model) // dep.ep
    inter = model.moe_intermediate
    ops["experts"] = [_gemm("expert_gate_up", h, 2 * inter, dt, w, rows=pairs, experts=local),
                      _pass("act_quant", pairs * (4.0 * inter + inter)),
                      _gemm("expert_down", inter, h, dt, w, rows=pairs, experts=local)]
    ops["combine_a"] = [_pass("send_outputs", 2.0 * pairs * h)]
    ops["combine_b"] = [_pass("weighted_reduce", 2.0 * pairs * h + 2.0 * h)]
    if model.num_shared_experts:
        si = inter * model.num_shared_experts
        ops["shared_experts"] = [_gemm("shared_gate_up", h, 2 * si, dt, w), _pass("shared_act", 5.0 * si),
                                 _gemm("shared_down", si, h, dt, w)]
    ops["output"] = [_pass("add_residual", 6.0 * h)]
    ops["comm_postprocess_layer"] = []
    if model.num_dense_layers:
        di = model.dense_intermediate
        ops["mlp"] = [_gemm("mlp_gate_up", h, 2 * di, dt, w), _pass("mlp_act", 5.0 * di),
                      _gemm("mlp_down", di, h, dt, w)]
    return ops


def _op_cost(kernels: list[Kernel], hw: Hardware, eff: Efficiency, sm_fraction: float = 1.0) -> Cost:
    """The op's exact piecewise-linear cost as a table at its breakpoints (and beyond the last, for the slope)."""
    if not kernels:
        return Cost(kind="constant", seconds=0.0)
    marks = {0.0, 1.0}
    for k in kernels:
        b = k.breakpoint(hw, eff, sm_fraction)
        if b is not None and b > 0:
            marks.add(b)
    marks.add(2.0 * max(marks) + 1.0)
    points = [(t, sum(k.seconds(t, hw, eff, sm_fraction) for k in kernels)) for t in sorted(marks)]
    return Cost(kind="table", points=points)


@dataclass(frozen=True)
class Prediction:
    """Predicted costs for a deployment, with the strategies they apply to.

    ``strategy`` is the whole model (dense layers, then MoE layers); ``layer`` one MoE layer. ``costs`` is a plain
    `CostModel`: save it (``costs.model_dump_json()``) for ``tbo simulate``, or pass it to `recommend`,
    `find_threshold` and `tune` as if it had been fitted from traces.
    """

    hardware: Hardware
    model: ModelShape
    deployment: Deployment
    efficiency: Efficiency
    layer: OperationsStrategy
    strategy: OperationsStrategy
    costs: CostModel
    traffic: dict[str, Traffic] = field(default_factory=dict)
    kernels: dict[str, list[Kernel]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  #: what the deployment asks of DeepEP's SMs and buffers, in words
    memory: MemoryUse | None = None  #: weights, KV cache and DeepEP buffers per GPU, against the device's memory

    def compare(self, tokens: int | None = None) -> Comparison:
        """Single batch vs TBO for the whole model at ``tokens`` (default: the deployment's tokens per device)."""
        return compare(self.strategy, self.costs, tokens or self.deployment.tokens_per_device)

    def recommend(self, tokens: int | None = None, min_gain: float = 1.0) -> Recommendation:
        return recommend(self.strategy, self.costs, tokens or self.deployment.tokens_per_device,
                         self.deployment.mode, min_gain)

    def threshold(self, max_tokens: int = 1 << 14, min_gain: float = 1.0) -> int | None:
        """The smallest tokens per device from which TBO is predicted to pay (None: not up to ``max_tokens``)."""
        return find_threshold(self.strategy, self.costs, self.deployment.mode, max_tokens, min_gain)


def _strategies(model: ModelShape, dep: Deployment, hw: Hardware) -> tuple[OperationsStrategy, OperationsStrategy]:
    shared = model.num_shared_experts > 0
    if dep.mode == "decode":
        layer = deepseek_decode() if shared else qwen3_moe_decode()
    else:
        layer = deepseek_prefill() if shared else qwen3_moe_prefill()
    # low-latency kernels hold SMs only to send and receive (ops of their own); the others hold comm_sms throughout
    comm_sms = dep.comm_sms_of(hw.num_sms) if dep.resolved_kernel != "low_latency" else 0
    whole_device = dep.takes_whole_device()  # V2 on one rank: every SM, by V2's own count
    if comm_sms >= hw.num_sms and not whole_device:  # a default larger than a small device (V1's 20)
        raise ValueError(f"comm_sms={comm_sms} leaves no SMs for compute on {hw.name} ({hw.num_sms} SMs)")
    num_sms = hw.num_sms - comm_sms if comm_sms and not whole_device else None
    # the strategy's own SM budget is the local GPU's (None without one): set the predicted cluster's instead
    layer = OperationsStrategy(operations=layer.operations, delta_stages=layer.delta_stages,
                               deep_gemm_num_sms=num_sms, name=layer.name)
    # dense layers first, their ops one stage (as `bind_layers` joins them): it takes the MoE layers' lead
    ops = list(DENSE_OPS) * model.num_dense_layers + list(layer.operations) * model.num_moe_layers
    whole = OperationsStrategy(operations=ops, delta_stages=layer.delta_stages, deep_gemm_num_sms=num_sms,
                               name=f"{model.name}_{layer.name}")
    if dep.resolved_kernel == "low_latency":  # a schedule that would hang the GPUs has no step time to predict
        from tbo.comm.deepep import LOW_LATENCY_LIMIT

        whole.check_in_flight(LOW_LATENCY_LIMIT)
    return layer, whole


def predict(hardware: str | Hardware, model: str | ModelShape, deployment: Deployment,
            efficiency: Efficiency = DEFAULT_EFFICIENCY) -> Prediction:
    """The cost model of ``deployment`` of ``model`` on ``hardware`` (preset names or objects).

    A ``comm_sms`` the device does not have is refused. A deployment the device cannot hold is predicted with a
    note saying so, with the figures (``Prediction.memory``, `memory_use`); ``tbo predict`` refuses it."""
    hw, shape, dep, eff = get_hardware(hardware), get_model(model), deployment, efficiency
    if dep.ep > hw.gpus_per_node and dep.ep % hw.gpus_per_node:
        raise ValueError(f"ep={dep.ep} spans nodes but is not a multiple of {hw.gpus_per_node} GPUs per node")
    dep.check_sms(hw.num_sms, hw.name)
    kernel = dep.resolved_kernel
    layer, strategy = _strategies(shape, dep, hw)
    kernels = layer_kernels(shape, dep, hw)
    memory = memory_use(shape, dep, hw, kernels)
    # V2 on one rank, the one case where DeepEP holds every SM. (It once read the comm_sms alone, so that an SM count
    # above the device's turned a low-latency EP32 deployment into "V2 on one rank".)
    whole_device = dep.takes_whole_device()
    notes: list[str] = [] if memory.fits else [f"does not fit: {memory.describe()}"]
    epilogue_kernels: dict[str, list[Kernel]] = {}
    if kernel == "v2":  # the receive-side passes are V2's epilogues, on every SM
        epilogue_kernels = {"dispatch": kernels.pop("dispatch_b"), "combine": kernels.pop("combine_b")}
        kernels["dispatch_b"], kernels["combine_b"] = [], []
        notes.append(f"DeepEP V2's copy and reduce epilogues run on all {hw.num_sms} SMs: charged as device-wide "
                     "compute when each transfer is waited for")
    ops = {name: _op_cost(ks, hw, eff) for name, ks in kernels.items()}
    overlapped: dict[str, tuple[Cost, Cost]] = {}
    if layer.deep_gemm_num_sms is not None:  # communication holds SMs while microbatches overlap
        fraction = layer.deep_gemm_num_sms / hw.num_sms
        for name, ks in kernels.items():
            c = _op_cost(ks, hw, eff, fraction)
            overlapped[name] = (c, c)
    if kernel == "normal" and dep.resolved_comm_sms != 20:
        notes.append(f"DeepEP V1 normal buffers are sized for the Buffer.num_sms in effect when made: set it to "
                     f"{dep.resolved_comm_sms} (tbo.comm.sm_budget.deep_ep_num_sms) before building them, or the "
                     "kernels overrun them")
    slots = dep.slots(shape)
    grouped = slots == shape.num_experts
    flows = {kind: traffic(kind, kernel, shape.hidden, shape.topk, dep.ep, hw.gpus_per_node, slots,
                           shape.num_groups if grouped else 1, shape.topk_groups if grouped else 1,
                           dep.dispatch_dtype)
             for kind in ("dispatch", "combine")}
    # one link in the simulator: the bottleneck's effective rate, with each transfer's time per token expressed in
    # bytes at that rate (the same link is the bottleneck for both: their byte ratios are equal)
    nic_rate = eff.nic_efficiency * hw.nic_bandwidth
    nvl_rate = eff.nvlink_efficiency * hw.nvlink_bandwidth
    d = flows["dispatch"]
    rate = nic_rate if d.nic_bytes / nic_rate >= d.nvlink_bytes / nvl_rate else nvl_rate
    skew = 1.0 / dep.balancedness  # the busiest receiver sets the pace
    transfers = {kind: TransferCost(bytes_per_token=t.seconds_per_token(hw, eff) * rate * skew)
                 for kind, t in flows.items()}
    latency = hw.message_latency_s
    epilogues = {kind: _op_cost(ks, hw, eff) for kind, ks in epilogue_kernels.items()}
    if whole_device:  # nothing overlaps a kernel that holds every SM: the transfer is device-wide time too
        notes.append(f"DeepEP V2 on one rank takes all {hw.num_sms} SMs (get_theoretical_num_sms with no traffic): "
                     "nothing runs beside its kernels, so TBO cannot hide them and DeepGEMM gets no budget")
        for kind in ("dispatch", "combine"):
            base = epilogues.get(kind, Cost(kind="constant"))
            per_token = transfers[kind].bytes_per_token / rate
            epilogues[kind] = Cost(kind="table", points=[(x, y + latency + per_token * x) for x, y in
                                                         (base.points or [(0.0, base.seconds), (1.0, base.seconds)])])
        transfers, latency = {}, 0.0
    costs = CostModel(ops=ops, transfers=transfers, latency_s=latency, bandwidth=rate, overlapped=overlapped,
                      epilogues=epilogues)
    kernels.update({f"{kind}_epilogue": ks for kind, ks in epilogue_kernels.items()})
    return Prediction(hw, shape, dep, eff, layer, strategy, costs, flows, kernels, tuple(notes), memory)


def split_policy(hardware: str | Hardware, model: str | ModelShape, decode: Deployment | None = None,
                 prefill: Deployment | None = None, max_tokens: int = 1 << 14,
                 efficiency: Efficiency = DEFAULT_EFFICIENCY) -> SplitPolicy:
    """A `SplitPolicy` whose thresholds are the predicted break-even token counts of a cluster not yet measured.

    Where TBO is never predicted to pay up to ``max_tokens``, the threshold is ``max_tokens + 1`` (never split in
    that range). A phase not given keeps SplitPolicy's default.
    """
    fields: dict[str, int] = {}
    for dep, key in ((decode, "decode_token_threshold"), (prefill, "prefill_token_threshold")):
        if dep is None:
            continue
        n = predict(hardware, model, dep, efficiency).threshold(max_tokens)
        fields[key] = max(n if n is not None else max_tokens + 1, 2)
    return SplitPolicy(**fields)
