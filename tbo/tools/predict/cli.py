"""``tbo predict comm|step|sweep|tp``: the prediction from the command line, one ``key: value`` line per figure."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import ValidationError

from tbo.tools.inputs import positive
from tbo.tools.simulate import simulate, split_tokens, summary
from tbo.tools.predict.comm import traffic, transfer_seconds
from tbo.tools.predict.costs import Prediction, predict
from tbo.tools.predict.hardware import HARDWARE, DEFAULT_EFFICIENCY, get_hardware
from tbo.tools.predict.model import MODELS, Deployment
from tbo.util.optional import extra_hint

__all__ = ["add_parser", "breakdown"]

KERNELS = ("low_latency", "normal", "v2")


def _cmd_comm(args: argparse.Namespace) -> int:
    if args.topk > args.experts:
        raise ValueError(f"--topk {args.topk} exceeds --experts {args.experts}: a token picks distinct experts")
    if args.topk_groups > args.groups or args.experts % args.groups:
        raise ValueError(f"--topk-groups {args.topk_groups} / --groups {args.groups} / --experts {args.experts}: "
                         "the groups must divide the experts, and a token uses at most --groups of them")
    hw = get_hardware(args.hardware)
    for kind in ("dispatch", "combine"):
        t = traffic(kind, args.kernel, args.hidden, args.topk, args.ep, hw.gpus_per_node, args.experts,
                    args.groups, args.topk_groups, args.dispatch_dtype)
        print(f"{kind}_us: {transfer_seconds(t, args.tokens, hw, DEFAULT_EFFICIENCY) * 1e6:.3f}")
    for kind in ("dispatch", "combine"):
        t = traffic(kind, args.kernel, args.hidden, args.topk, args.ep, hw.gpus_per_node, args.experts,
                    args.groups, args.topk_groups, args.dispatch_dtype)
        print(f"{kind}_bytes: nic {t.nic_bytes * args.tokens:.0f}, nvlink {t.nvlink_bytes * args.tokens:.0f}")
    return 0


def _deployment(args: argparse.Namespace, ep: int | None = None, tokens: int | None = None) -> Deployment:
    try:
        return Deployment(ep=ep or args.ep, tokens_per_device=tokens or args.tokens_per_device, context=args.context,
                          mode=args.mode, kernel=args.kernel, comm_sms=args.comm_sms, expert_slots=args.expert_slots,
                          weight_dtype=args.weight_dtype, kv_bytes=args.kv_bytes, balancedness=args.balancedness)
    except ValidationError as exc:  # one line per flag, named as typed: not pydantic's multi-line dump
        raise ValueError(_flag_errors(exc)) from None


def _flag_errors(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        flag = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
        parts.append(f"{flag} {err.get('input')!r}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def breakdown(p: Prediction, tokens: int) -> list[str]:
    """Per-stage compute (waits excluded) and per-transfer times for one MoE layer, simulated single-batch and
    overlapped on the real strategy: where the time goes, not the layer's step (see ``per_layer_us``)."""
    single = simulate(p.layer, p.costs, [tokens], 0).trace
    parts = split_tokens(tokens)
    tbo = simulate(p.layer, p.costs, parts).trace
    lines = []
    def ops(trace, stage, mb=None):  # op spans (an epilogue span lies inside its op's), waits excluded
        busy = sum(s.duration for s in trace.lane("compute") if s.stage == stage and mb in (None, s.mb)
                   and not s.name.endswith("_epilogue"))
        return busy - sum(s.duration for s in trace.lane("wait") if s.stage == stage and mb in (None, s.mb))

    for stage, names in enumerate(p.layer.stage_names):
        one = ops(single, stage)
        per_mb = [ops(tbo, stage, mb) for mb in range(len(parts))]
        lines.append(f"stage {stage} [{', '.join(names)}]: single_us: {one * 1e6:.1f} | tbo_us: "
                     + " + ".join(f"{x * 1e6:.1f}" for x in per_mb))
    for kind in p.costs.transfers:
        one = p.costs.transfer(kind, tokens)[1] + p.costs.latency_s
        split = [p.costs.transfer(kind, n)[1] + p.costs.latency_s for n in parts]
        lines.append(f"transfer {kind}: single_us: {one * 1e6:.1f} | tbo_us: "
                     + " + ".join(f"{x * 1e6:.1f}" for x in split))
    return lines


def _fits(p: Prediction, args: argparse.Namespace) -> None:
    """Refuse a deployment the GPU cannot hold, with the figures (unless --no-memory-check)."""
    if not p.memory.fits and not args.no_memory_check:
        dep = p.deployment
        raise ValueError(f"{p.model.name} at EP{dep.ep}, {dep.tokens_per_device} tokens/device, context "
                         f"{dep.context} does not fit: {p.memory.describe()}. Fewer tokens or a shorter context, a "
                         "larger EP, --kv-bytes 1 (FP8 KV cache), or --no-memory-check to predict it anyway")


def _cmd_step(args: argparse.Namespace) -> int:
    p = predict(args.hardware, args.model, _deployment(args))
    _fits(p, args)
    c = p.compare()
    tbo = summary(c.tbo.trace)
    print(f"single_ms: {c.single.step_s * 1e3:.4f}")
    print(f"tbo_ms: {c.tbo.step_s * 1e3:.4f}")
    print(f"speedup: {c.speedup:.4f}")
    print(f"bound_ms: {c.lower_bound_s * 1e3:.4f}")
    print(f"tbo_exposed_comm_ms: {tbo.exposed_s * 1e3:.4f}")
    print(f"per_layer_us: single {c.single.step_s / p.model.num_layers * 1e6:.1f}, "
          f"tbo {c.tbo.step_s / p.model.num_layers * 1e6:.1f}")
    print(f"memory: {p.memory.describe()}")
    dep = p.deployment
    print(f"# {p.model.name} on {p.hardware.name}: {dep.mode}, EP{dep.ep}, {dep.tokens_per_device} tokens/device, "
          f"context {dep.context}, {dep.resolved_kernel} kernels, {p.model.num_layers} layers "
          f"(layers only: no embedding, LM head or sampling); one MoE layer ({p.layer.name}):")
    for line in breakdown(p, dep.tokens_per_device):
        print(line)
    for note in p.notes:
        if not note.startswith("does not fit"):  # said as the memory line (and only seen with --no-memory-check)
            print(f"note: {note}")
    print(p.recommend().reason)
    if args.costs_out:
        Path(args.costs_out).write_text(p.costs.model_dump_json(indent=1))
        print(f"wrote {args.costs_out} (use: tbo simulate STRATEGY.json --costs {args.costs_out})")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    curves: dict[int, list[tuple[int, float]]] = {}
    for ep in args.ep:
        for n in args.tokens:
            p = predict(args.hardware, args.model, _deployment(args, ep=ep, tokens=n))
            if not p.memory.fits and not args.no_memory_check:  # a point that cannot run is left off the plot
                print(f"ep: {ep} tokens_per_device: {n} does not fit: {p.memory.describe()}")
                continue
            s = p.compare().speedup
            curves.setdefault(ep, []).append((n, s))
            print(f"ep: {ep} tokens_per_device: {n} speedup: {s:.4f}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is an optional extra
        raise ImportError(f"tbo predict sweep needs matplotlib: {extra_hint('plot')}") from exc
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ep, pts in curves.items():
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"EP {ep}")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{'prompt ' if args.mode == 'prefill' else ''}tokens per device")
    ax.set_ylabel("predicted TBO speedup (single / TBO step)")
    ax.set_title(f"{args.model} on {args.hardware}, {args.mode}, context {args.context}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    plt.close(fig)
    print(f"wrote {args.out}")
    return 0


def _cmd_tp(args: argparse.Namespace) -> int:
    from tbo.tools.predict.tensor_parallel import predict_tp

    p = predict_tp(args.hardware, args.model, tp=args.tp, link=args.link, mode=args.mode, context=args.context,
                   kv_bytes=args.kv_bytes, weight_dtype=args.weight_dtype)
    n = args.tokens
    single, tbo = p.steps(n)
    whole, halves = p.allreduce(n), p.allreduce(n // 2)
    print(f"single_ms: {single * 1e3:.4f}")
    print(f"tbo_ms: {tbo * 1e3:.4f}")
    print(f"speedup: {single / tbo:.4f}")
    print(f"allreduce_us: whole {whole[0] * 1e6:.1f} ({whole[1]}), half {halves[0] * 1e6:.1f} ({halves[1]})")
    if whole[1] == "two-shot" and halves[1] == "one-shot":
        print(f"note: the halves fall under the one-shot cut-off: split, each layer's all-reduces take "
              f"{2 * halves[0] / whole[0]:.2f}x the link time of the unsplit step's (RFC vllm#56126's trap)")
    cross = p.crossover(range(2, args.max_tokens + 1, 2))
    print(f"crossover_tokens: {cross if cross is not None else f'none up to {args.max_tokens}'}")
    print(f"# {p.model.name} at TP {p.tp} on {p.hardware.name} over {p.link.name}: {p.mode}, {n} tokens, context "
          f"{p.context}, {p.model.num_layers} layers (dense_tp_{p.mode}; layers only)")
    return 0


def _cmd_afd(args: argparse.Namespace) -> int:
    from tbo.comm.emulated import parse_link_spec
    from tbo.tools.afd_pipeline import parse_counts, report
    from tbo.tools.predict.afd import afd_costs

    p = predict(args.hardware, args.model, _deployment(args))
    latency, bandwidth = parse_link_spec(args.link) if args.link else (None, None)
    costs = afd_costs(p, latency, bandwidth)
    print(f"# {p.model.name} on {p.hardware.name} as AFD: {p.deployment.mode}, {args.tokens_per_device} tokens per "
          f"attention GPU, context {p.deployment.context}, experts over EP{p.deployment.ep}; "
          f"per layer unsplit: attention {costs.attention(args.tokens_per_device) * 1e6:.1f} us, "
          f"FFN {costs.ffn(args.tokens_per_device) * 1e6:.1f} us")
    for line in report(costs, args.tokens_per_device, parse_counts(args.microbatches)):
        print(line)
    return 0


def _deployment_args(p: argparse.ArgumentParser, many: bool = False) -> None:
    p.add_argument("--hardware", required=True, help=f"{', '.join(HARDWARE)} or a Hardware JSON file")
    p.add_argument("--model", required=True, help=f"{', '.join(MODELS)} or a Hugging Face config.json")
    if many:
        p.add_argument("--ep", type=positive, nargs="+", required=True, help="EP sizes, one line each")
        p.add_argument("--tokens", type=positive, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024],
                       help="tokens per device to sweep")
    else:
        p.add_argument("--ep", type=positive, required=True, help="expert-parallel size (GPUs)")
        p.add_argument("--tokens-per-device", type=positive, required=True,
                       help="tokens one GPU runs per step (prefill: prompt tokens)")
    p.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    p.add_argument("--context", type=positive, required=True, help="KV length (decode) or prompt length (prefill)")
    p.add_argument("--kernel", choices=KERNELS, default=None, help="DeepEP kernels (default: by mode)")
    p.add_argument("--comm-sms", type=int, default=None, help="SMs the normal/V2 kernels hold (default 20 / 12-6)")
    p.add_argument("--expert-slots", type=positive, default=None, help="expert copies, e.g. 288 with EPLB")
    p.add_argument("--weight-dtype", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--kv-bytes", type=float, default=2.0, help="bytes per KV element (2: BF16, 1: FP8)")
    p.add_argument("--balancedness", type=float, default=1.0, help="mean/max expert load per GPU (1: balanced)")
    p.add_argument("--no-memory-check", action="store_true",
                   help="predict a deployment whose weights, KV cache and DeepEP buffers exceed the GPU's memory")


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register ``tbo predict`` and its subcommands on the ``tbo`` command's subparsers."""
    top = sub.add_parser("predict", help="predict TBO's gain from hardware and model specs (no traces needed)")
    cmds = top.add_subparsers(dest="predict_command", required=True)
    comm = cmds.add_parser("comm", help="DeepEP dispatch and combine times from message sizes")
    comm.add_argument("--hardware", required=True, help=f"{', '.join(HARDWARE)} or a Hardware JSON file")
    comm.add_argument("--ep", type=positive, required=True)
    comm.add_argument("--tokens", type=positive, required=True, help="tokens one GPU sends")
    comm.add_argument("--hidden", type=positive, required=True)
    comm.add_argument("--topk", type=positive, required=True)
    comm.add_argument("--kernel", choices=KERNELS, default="low_latency")
    comm.add_argument("--experts", type=positive, default=256, help="routed experts (normal/V2 deduplicate by them)")
    comm.add_argument("--groups", type=positive, default=1, help="expert groups (group-limited routing)")
    comm.add_argument("--topk-groups", type=positive, default=1, help="groups a token may use")
    comm.add_argument("--dispatch-dtype", choices=("fp8", "bf16"), default="fp8")
    comm.set_defaults(func=_cmd_comm)
    step = cmds.add_parser("step", help="single-batch vs TBO step time for a deployment, with a per-stage breakdown")
    _deployment_args(step)
    step.add_argument("--costs-out", help="write the predicted CostModel JSON (for tbo simulate)")
    step.set_defaults(func=_cmd_step)
    afd = cmds.add_parser("afd", help="AFD at N microbatches: which count keeps the attention side busy across "
                                      "the round trip (MegaScale-Infer's ping-pong condition)")
    _deployment_args(afd)
    afd.add_argument("--link", metavar="LATENCY_US,GBPS",
                     help="the attention-FFN link, each way (default: the hardware's message latency and NIC)")
    afd.add_argument("--microbatches", default="2,3,4", help="the counts to compare (default 2,3,4)")
    afd.set_defaults(func=_cmd_afd)
    sweep = cmds.add_parser("sweep", help="plot speedup against tokens per device, one line per EP size (PNG)")
    _deployment_args(sweep, many=True)
    sweep.add_argument("--out", default="tbo_predict_sweep.png", help="PNG path")
    sweep.set_defaults(func=_cmd_sweep)
    from tbo.tools.predict.tensor_parallel import DENSE_MODELS, TP_GPUS, TP_LINKS

    tp = cmds.add_parser("tp", help="a dense model under tensor parallelism: the all-reduce's overlap, the one-shot "
                                    "cut-off, and from how many tokens splitting pays")
    tp.add_argument("--hardware", required=True, help=f"{', '.join([*HARDWARE, *TP_GPUS])}")
    tp.add_argument("--model", required=True, help=f"{', '.join(DENSE_MODELS)} or a dense Hugging Face config.json")
    tp.add_argument("--tp", type=positive, required=True, help="tensor-parallel size (GPUs)")
    tp.add_argument("--link", choices=tuple(TP_LINKS), default="nvlink")
    tp.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    tp.add_argument("--tokens", type=positive, required=True, help="tokens per step (prefill: prompt tokens)")
    tp.add_argument("--context", type=positive, default=1024, help="KV length (decode) or prompt length (prefill)")
    tp.add_argument("--kv-bytes", type=float, default=2.0, help="bytes per KV element (2: BF16, 1: FP8)")
    tp.add_argument("--weight-dtype", choices=("fp8", "bf16"), default="bf16")
    tp.add_argument("--max-tokens", type=positive, default=1024, help="the crossover scan's upper end")
    tp.set_defaults(func=_cmd_tp)
