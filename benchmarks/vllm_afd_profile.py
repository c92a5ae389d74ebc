"""Where one decode step of AFD inside vLLM spends its time, on both sides, without and with DBO.

`benchmarks/vllm_afd.py` gives the step times; this says why. It starts the same two engines and FFN servers (same
model, same workload, same cores) with timestamps around every op: on the engine, each layer op (attention, norms,
``afd_send``, ``afd_recv``); on the server, the wait for each request's header, its payload, the FFN, the send back.
``time.perf_counter`` is CLOCK_MONOTONIC, one clock for both processes, so the two timelines line up: the report
says, per decode step, how long the engine computed, sent and waited, and how long the server waited, received,
computed and sent. ``--timeline`` prints one step's events of both sides in time order.

    .venv-vllm/bin/python benchmarks/vllm_afd_profile.py --layers 8 --moe-intermediate 1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from tbo.harness.scripts import load_script

afd_bench = load_script(HERE / "vllm_afd.py")
bench = afd_bench.bench

#: runs each `tbo afd-ffn` process (``python -c _SERVER OUT afd-ffn ...``): times its requests, writes them to OUT
#: at exit
_SERVER = r"""
import atexit, json, sys, time
from tbo.afd.connector import TorchDistributedAFDConnector as C
from tbo.integrations.vllm.afd import ffn
events = []
def timed(name, fn, meta_of):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        events.append((name, t0, time.perf_counter(), meta_of(a, out)))
        return out
    return wrapper
C.recv_attn_output = timed("recv", C.recv_attn_output, lambda a, out: [out[1].layer_idx, out[1].microbatch_idx,
                                                                      out[1].num_microbatches])
C.send_ffn_output = timed("send", C.send_ffn_output, lambda a, out: [a[2].layer_idx, a[2].microbatch_idx,
                                                                   a[2].num_microbatches])
ffn._FFNLayer.ffn = timed("ffn", ffn._FFNLayer.ffn, lambda a, out: [out.shape[0]])
out = sys.argv.pop(1)
atexit.register(lambda: json.dump(events, open(out, "w")))
from tbo.tools.cli import main
sys.exit(main())
"""

_ENGINE_OPS = ("comm_prepare_attn", "attn_prepare", "attn_core", "comm_prepare_mlp", "afd_send", "afd_recv", "output",
               "comm_postprocess_layer")


def patch_engine(events: list) -> None:
    """Time every op of `VllmAFDLayer` and every model forward, in this (the engine's) process."""
    from tbo.integrations.vllm.afd.attention import VllmAFDLayer
    from tbo.integrations.vllm.runner.loop import LayerLoop

    def timed(name, fn):
        def wrapper(self, state, *a, **k):
            t0 = time.perf_counter()
            out = fn(self, state, *a, **k)
            events.append((name, t0, time.perf_counter(), [self.layer_idx, state.get("microbatch_idx", 0)]))
            return out
        return wrapper

    for op in _ENGINE_OPS:
        setattr(VllmAFDLayer, f"op_{op}", timed(op, getattr(VllmAFDLayer, f"op_{op}")))
    call = LayerLoop.__call__

    def forward(self, *a, **k):
        t0 = time.perf_counter()
        out = call(self, *a, **k)
        events.append(("forward", t0, time.perf_counter(), []))
        return out

    LayerLoop.__call__ = forward


def decode_windows(llm, work) -> list[tuple[float, float]]:
    """Run the decode workload; return the (start, end) of each timed decode step (`Workload.decode_window`)."""
    work._add(llm, work.context, work.decode_window.stop + 1)
    windows = []
    while llm.llm_engine.has_unfinished_requests():
        t = time.perf_counter()
        llm.llm_engine.step()
        windows.append((t, time.perf_counter()))
    return windows[work.decode_window]


def breakdown(windows, engine_events, server_events) -> dict[str, float]:
    """Per-step medians (ms) of each side's time by kind."""
    rows = defaultdict(list)
    for t0, t1 in windows:
        sums = defaultdict(float)
        for name, a, b, _ in engine_events:
            if t0 <= a and b <= t1:
                kind = name if name in ("afd_send", "afd_recv", "forward") else "attention ops"
                sums["engine " + kind] += b - a
        for name, a, b, _ in server_events:
            if t0 <= a and b <= t1:
                sums["server " + name] += b - a
        sums["step"] = t1 - t0
        tokens = [meta[0] for name, a, b, meta in server_events if name == "ffn" and t0 <= a and b <= t1]
        rows["tokens per FFN call (max)"].append(max(tokens, default=0))
        for k, v in sums.items():
            rows[k].append(v * 1e3)
    return {k: statistics.median(v) for k, v in sorted(rows.items())}


def timeline(window, engine_events, server_events) -> None:
    t0, t1 = window
    evs = [("engine", *e) for e in engine_events if t0 <= e[1] and e[2] <= t1 and e[0] != "forward"]
    evs += [("server", *e) for e in server_events if t0 <= e[1] and e[2] <= t1]
    for side, name, a, b, meta in sorted(evs, key=lambda e: e[2]):
        print(f"  {(a - t0) * 1e3:8.3f} {(b - t0) * 1e3:8.3f} {(b - a) * 1e3:7.3f} {side:6s} {name:22s} {meta}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--moe-intermediate", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--timeline", action="store_true", help="print one DBO and one unsplit decode step's events")
    args = p.parse_args()

    import torch

    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    max_tokens = max(1024, args.batch * 16)
    work = afd_bench.Workload(args.batch, 16, args.decode_tokens, args.context, max_tokens)
    never = {"decode_token_threshold": 1 << 30, "prefill_token_threshold": 1 << 30}
    split = {"decode_token_threshold": 2, "prefill_token_threshold": 12}
    engine_events: list = []
    patch_engine(engine_events)
    servers = []
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = afd_bench.save_model(Path(tmp) / "qwen3_moe", args.hidden, args.layers, args.experts, args.heads,
                                     args.moe_intermediate)
        try:
            engines, windows = {}, {}
            for name, tbo in (("no DBO", never), ("DBO", split)):
                proc, address = afd_bench.start_server(model, args.dtype, max_tokens, 1,
                                                       ("-c", _SERVER, str(Path(tmp) / f"{name}.json")))
                servers.append((name, proc))
                engines[name] = bench.start_engine(model, {**tbo, "afd": {"ffn": address}}, work, args.dtype)
                windows[name] = []
            for r in range(args.repeats + 1):
                for name, llm in engines.items():
                    w = decode_windows(llm, work)
                    if r:
                        windows[name] += w
            bench.close(engines)
            for name, proc in servers:
                proc.stdout.read()
                assert proc.wait(60) == 0
                server_events = json.load(open(Path(tmp) / f"{name}.json"))
                results[name] = breakdown(windows[name], engine_events, server_events)
                if args.timeline:
                    print(f"{name}: one decode step (ms from its start; end; duration; side; event; layer, stage)")
                    timeline(windows[name][len(windows[name]) // 2], engine_events, server_events)
        finally:
            for _, proc in servers:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    keys = sorted({k for r in results.values() for k in r})
    print(f"per decode step, median ms ({args.batch} requests over {args.context} tokens, {args.layers} layers)")
    print(f"{'':28s}" + "".join(f"{n:>10s}" for n in results))
    for k in keys:
        print(f"{k:28s}" + "".join(f"{r.get(k, 0.0):10.2f}" for r in results.values()))


if __name__ == "__main__":
    main()
