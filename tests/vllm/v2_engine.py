"""One process running vLLM engines on Model Runner V2 for tests/vllm/test_v2.py: ``python v2_engine.py SPEC OUT``.

Model Runner V2 runs on a CPU only with the Triton shims of tests/triton_site (its ``sitecustomize``), which must
never reach a V1 engine: so the V2 engines run here, in a process of their own with that folder on its path
(`run_v2`), never in the pytest process. SPEC (JSON) lists engines, each ``{"engine": {...LLM kwargs}, "tbo": {...} or
null, "runs": [{"prompts": [[ids]], "max_tokens": n}]}``; they run one after the other, in-process (no engine
subprocess, so that tbo's ``stats()`` sees them). OUT gets, per engine, ``{"error": "<Type>: <message>"}`` if it did
not start, else its ``runner`` class and, per run, its greedy ``tokens`` and what tbo's counters did meanwhile
(``stats``), and the steps tbo's prefix-cache rule kept whole (``vetoes``); with tbo, its emulated links (``links``)
and the seconds they booked (``booked_s``). An engine with ``tensor_parallel_size``
2 runs its two workers in processes of their own (``VLLM_CPU_OMP_THREADS_BIND="0|1"`` while it runs): its result
has, per worker (``workers``, asked by ``collective_rpc``), the runner, whether tbo is on it, each layer's kind and
the reductions it runs as tbo's transfers, and the adaptive policy's report; and per run, each worker's counters
(``stats``, a list).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SITE = Path(__file__).resolve().parents[1] / "triton_site"


def run_v2(tmp_path: Path, engines: list[dict[str, Any]], timeout_s: float = 900) -> list[dict[str, Any]]:
    """Run ``engines`` (module docstring) in one V2 process; returns each engine's result."""
    spec, out = tmp_path / "v2-spec.json", tmp_path / "v2-out.json"
    spec.write_text(json.dumps(engines))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE), str(root), os.environ.get("PYTHONPATH", "")]),
           "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, __file__, str(spec), str(out)], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0 and out.exists(), f"V2 engine process rc={proc.returncode}\n{proc.stdout[-3000:]}\n" \
                                                  f"{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def _delta(after: Any, before: Any) -> Any:
    """What counters did between two `stats()`: dicts key by key, numbers subtracted, anything else (the adaptive
    policies' reports) as it is after."""
    if isinstance(after, dict):
        return {k: _delta(v, before.get(k, 0) if isinstance(before, dict) else 0) for k, v in after.items()}
    return after - before if isinstance(after, (int, float)) and isinstance(before, (int, float)) else after


def _worker_report(worker: Any) -> dict[str, Any]:
    """In a TP worker: its runner, tbo on it, its counters (self-contained: pickled by value to the worker)."""
    from tbo.integrations.vllm import stats

    runner = getattr(worker, "worker", worker).model_runner
    engine = vars(runner).get("tbo")
    return {"runner": f"{type(runner).__module__}.{type(runner).__qualname__}", "tbo": engine is not None,
            "stats": stats(),
            "deferred": [] if engine is None else [[layer.kind, sorted(layer.deferred)] for layer in engine.layers],
            "adaptive": None if engine is None or engine.adaptive is None else engine.adaptive.report(),
            "links": [] if engine is None else [type(link).__name__ for link in engine._links()],
            "booked_s": 0.0 if engine is None else sum(link.booked_s for link in engine._links())}


def _tp_engine(llm: Any, item: dict[str, Any]) -> dict[str, Any]:
    """An engine of TP workers (module docstring): each worker's report, each run's tokens and per-worker counters."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    result: dict[str, Any] = {"runs": []}
    for run in item["runs"]:
        params = SamplingParams(temperature=0, max_tokens=run["max_tokens"], detokenize=False, ignore_eos=True)
        before = llm.collective_rpc(_worker_report)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in run["prompts"]], params, use_tqdm=False)
        after = llm.collective_rpc(_worker_report)
        result["runs"].append({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                               "stats": [_delta(a["stats"], b["stats"]) for a, b in zip(after, before)]})
    result["workers"] = llm.collective_rpc(_worker_report)
    return result


def _engine(item: dict[str, Any]) -> dict[str, Any]:
    tp = item["engine"].get("tensor_parallel_size", 1)
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    try:
        return _one_engine(item, tp)
    finally:
        if tp > 1:
            if bind is None:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            else:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind


def _one_engine(item: dict[str, Any], tp: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tbo.integrations.vllm import stats

    extra = {} if item.get("tbo") is None else {"additional_config": {"tbo": item["tbo"]}}
    try:
        llm = LLM(**item["engine"], **extra)
    except Exception as e:  # noqa: BLE001 - a refusal is the result
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        if tp > 1:
            return _tp_engine(llm, item)
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        result: dict[str, Any] = {"runner": f"{type(runner).__module__}.{type(runner).__qualname__}",
                                  "tbo": "tbo" in vars(runner), "runs": []}
        for run in item["runs"]:
            params = SamplingParams(temperature=0, max_tokens=run["max_tokens"], detokenize=False, ignore_eos=True)
            engine = vars(runner).get("tbo")
            before, vetoes = stats(), 0 if engine is None else engine.patches.vetoes
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in run["prompts"]], params, use_tqdm=False)
            result["runs"].append({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                   "stats": _delta(stats(), before),
                                   "vetoes": None if engine is None else engine.patches.vetoes - vetoes})
        engine = vars(runner).get("tbo")
        if engine is not None:  # what its emulated links booked, if any (``link``): seconds on the wire
            result["links"] = [type(link).__name__ for link in engine._links()]
            result["booked_s"] = sum(link.booked_s for link in engine._links())
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main(spec: str, out: str) -> None:
    engines = json.loads(Path(spec).read_text())
    results = []
    for item in engines:  # an engine that fails while it runs is that engine's result; the others still run
        try:
            results.append(_engine(item))
        except Exception as e:  # noqa: BLE001
            results.append({"error": f"while running: {type(e).__name__}: {e}"})
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
