"""Record a served vLLM engine's ``/metrics`` while clients come and go, for `render_metrics_panels.py`: the same
server as ``tests/vllm/test_metrics.py`` (the tiny Qwen3-MoE, tbo with op_times, its stat logger), driven in rounds
that alternate single small requests (under both split thresholds: no step splits) with 16 concurrent ones, scraped
every 0.25 s. Run from the repository root in the vLLM venv:

    PYTHONPATH=$PWD .venv-vllm/bin/python scripts/record_metrics_run.py scrapes.json --rounds 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.vllm.helpers import (MAX_TOKENS, SCENARIOS, TBO, _openai_server, _post,  # noqa: E402
                                _save_qwen3_moe)
from tests.served import scrape  # noqa: E402
from tests.vllm.test_metrics import _entry_point_dist  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the recording to write (JSON)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = _save_qwen3_moe(root / "qwen3_moe")
        env = {"PYTHONPATH": f"{ROOT}:{_entry_point_dist(root / 'plugins')}", "VLLM_CPU_KVCACHE_SPACE": "1"}
        tbo = {**TBO, "metrics_interval_s": 0.2}
        with _openai_server(model, tbo, root / "server.log", env=env) as base:
            frames, stop = [], threading.Event()

            def watch() -> None:
                while not stop.is_set():
                    frames.append((time.time(), {k: v for k, v in scrape(base).items() if k.startswith("tbo:")}))
                    time.sleep(0.25)

            def complete(p: list[int]) -> None:
                _post(base + "/v1/completions", {"model": str(model), "prompt": p, "max_tokens": MAX_TOKENS,
                                                 "temperature": 0, "ignore_eos": True})

            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                for _ in range(args.rounds):
                    for _ in range(3):
                        complete(SCENARIOS["small"][0])
                    with ThreadPoolExecutor(16) as pool:
                        list(pool.map(complete, SCENARIOS["served"] * 2))
                time.sleep(1)
            finally:
                stop.set()
                watcher.join()
    Path(args.out).write_text(json.dumps(frames))
    print(f"wrote {args.out}: {len(frames)} scrapes over {frames[-1][0] - frames[0][0]:.1f} s")


if __name__ == "__main__":
    main()
