"""AFD soak: 20,000 requests through a real `AFDGroup` (its authenticated socket on loopback), the FFN server's RSS after warm-up and at
the end. Prints ``rss_growth_mib: <x>`` (target: under 5 MiB after the warm-up's 2,000 requests), the join's
time (``join_ms``: the handshake, once per join) and a request's round trip (``request_us``: every step pays it).

What it guards: what a long-running FFN server keeps per request is bounded (its request log, `AFDFFNServer.received`,
keeps the last ``log_size`` headers; it used to keep every one, about 177 bytes each: 15 GB a day at 1,000
requests/s). The two sides are threads of one process, so the RSS is both sides' together: any per-request growth on
either shows.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from tbo.afd import AFDFFNServer, AFDMeta, AFDTopology, TorchDistributedAFDConnector
from tbo.afd.group import AFDGroup


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class _EchoLayer:
    @staticmethod
    def ffn(x: torch.Tensor) -> torch.Tensor:
        return x * 2


class _EchoModel:
    layers = [_EchoLayer(), _EchoLayer()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--warmup", type=int, default=2_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bound: list[int] = []
    served: list[int] = []

    def ffn_side() -> None:
        group = AFDGroup.listen("127.0.0.1:0", {"tbo_afd": 1}, timeout_s=60, on_listening=lambda h, p: bound.append(p))
        connector = TorchDistributedAFDConnector(AFDTopology(1, 1), 60, group=group, max_request_bytes=8 * 64 * 4)
        served.append(AFDFFNServer(_EchoModel(), connector, log_size=1024).serve())
        group.close()

    thread = threading.Thread(target=ffn_side, daemon=True)
    thread.start()
    while not bound:
        thread.join(0.05)
    t0 = time.perf_counter()
    group = AFDGroup.connect(f"127.0.0.1:{bound[0]}", timeout_s=60)
    join_ms = (time.perf_counter() - t0) * 1e3
    attention = TorchDistributedAFDConnector(AFDTopology(1, 1), 60, group=group)
    x = torch.randn(8, 64)
    rss = {}
    t0 = time.perf_counter()
    for i in range(args.requests):
        meta = AFDMeta(i % 2, 0, 1, 8, 64)
        attention.send_attn_output(x, meta)
        attention.recv_ffn_output(meta)
        if i + 1 in (args.warmup, args.requests):
            rss[i + 1] = _rss_mib()
    per_request_us = (time.perf_counter() - t0) / args.requests * 1e6
    attention.shutdown()
    thread.join(60)
    group.close()
    print(f"requests: {served[0]}")
    print(f"rss_mib_after_warmup: {rss[args.warmup]:.1f}")
    print(f"rss_mib_at_end: {rss[args.requests]:.1f}")
    print(f"join_ms: {join_ms:.1f}")
    print(f"request_us: {per_request_us:.0f}")
    print(f"rss_growth_mib: {rss[args.requests] - rss[args.warmup]:.2f}")


if __name__ == "__main__":
    main()
