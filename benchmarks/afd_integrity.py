"""What the AFD wire's integrity costs a step, measured on the wire alone: a decode step's traffic over a real
`SocketChannel` pair, without a secret, with ``integrity="headers"`` and with ``integrity="full"``.

Why a wire-only figure. `benchmarks/afd.py --integrity ...` measures whole steps, attention and FFN compute
included; on a shared machine their noise (10-20% between runs) hides a cost the 3% target is about. The MAC's cost
is CPU time on each side's reader and writer threads, spent per frame (a 16-byte header and the sequence number) and,
under "full", per payload byte. This script sends, per step, what `benchmarks/afd.py`'s decode case sends (512
sequences, hidden 1024, float32, 8 layers, 2 microbatches): per layer and microbatch an 80-byte metadata header and
the microbatch's hidden states to the FFN side, which answers with a header and hidden states of the same size. The
two channels run in one process over a socketpair (each with its own reader and writer threads, as in a pair of
processes), the modes interleaved step by step, so that drift falls on all three alike.

Prints each mode's median step time on the wire and what integrity adds to it, in ms and as a share of
``--step-ms`` (the decode step's split time that `benchmarks/afd.py` printed on this machine; the default 1728.2 is
the quiet run of 2026-12-07 documented in docs/hardening.md). Target: "headers" adds < 3% of a decode step.
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import statistics
import time

import torch

from tbo.afd.channel import SocketChannel

MODES = ("off", "headers", "full")


def _pair(mode: str) -> tuple[SocketChannel, SocketChannel]:
    a, b = socket.socketpair()
    if mode == "off":
        return SocketChannel(a, 0, "the FFN side", kv_budget=None), SocketChannel(b, 1, "the engine", kv_budget=None)
    up, down = hashlib.sha256(b"engine->server").digest(), hashlib.sha256(b"server->engine").digest()
    return (SocketChannel(a, 0, "the FFN side", kv_budget=None, integrity=(up, down, mode)),
            SocketChannel(b, 1, "the engine", kv_budget=None, integrity=(down, up, mode)))


def _step(engine: SocketChannel, ffn: SocketChannel, layers: int, hidden: torch.Tensor, header: torch.Tensor,
          inbox: tuple[torch.Tensor, torch.Tensor], outbox: tuple[torch.Tensor, torch.Tensor],
          microbatches: int) -> float:
    """One step's messages: per layer and microbatch, the request (header, hidden states) and its answer."""
    start = time.perf_counter()
    for _ in range(layers):
        for _ in range(microbatches):
            sent = [engine.send(header, 1), engine.send(hidden, 2)]
            got = [ffn.recv(inbox[0], 1), ffn.recv(inbox[1], 2)]
            for work in got + sent:
                work.wait()
            answered = [ffn.send(header, 3), ffn.send(inbox[1], 4)]
            back = [engine.recv(outbox[0], 3), engine.recv(outbox[1], 4)]
            for work in back + answered:
                work.wait()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--seqs", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=1728.2,
                        help="the decode step's split time (ms) that benchmarks/afd.py printed, for the share")
    args = parser.parse_args()
    rows = args.seqs // args.microbatches
    hidden = torch.randn(rows, args.hidden)
    header = torch.zeros(10, dtype=torch.int64)  # 80 bytes, as the connector's metadata header
    pairs = {mode: _pair(mode) for mode in MODES}
    buffers = {mode: ((torch.empty_like(header), torch.empty_like(hidden)),
                      (torch.empty_like(header), torch.empty_like(hidden))) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        for i in range(args.steps + 1):
            for mode in MODES[i % 3:] + MODES[: i % 3]:  # a rotating order
                seconds = _step(*pairs[mode], args.layers, hidden, header, *buffers[mode], args.microbatches)
                if i:  # the first round warms up
                    times[mode].append(seconds)
    finally:
        for engine, ffn in pairs.values():
            engine.close()
            ffn.close()
    mib = 2 * args.layers * args.microbatches * hidden.numel() * 4 / 2**20
    base = statistics.median(times["off"]) * 1e3
    print(f"decode step's traffic: {args.layers} layers x {args.microbatches} microbatches, {rows} rows x hidden "
          f"{args.hidden} float32: {mib:.0f} MiB each way... {args.steps} steps per mode, interleaved")
    for mode in MODES:
        ms = statistics.median(times[mode]) * 1e3
        added = ms - base
        print(f"  {mode:8s} {ms:8.1f} ms on the wire; adds {added:7.2f} ms = {100 * added / args.step_ms:5.2f}% "
              f"of a {args.step_ms:.0f} ms decode step")


if __name__ == "__main__":
    main()
