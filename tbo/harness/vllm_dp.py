"""Launch vLLM data-parallel ranks offline, one process each, as vLLM's ``examples/offline_inference/data_parallel.py``
does: ``VLLM_DP_RANK``, ``VLLM_DP_RANK_LOCAL``, ``VLLM_DP_SIZE``, ``VLLM_DP_MASTER_IP`` and ``VLLM_DP_MASTER_PORT`` set
per process, ``VLLM_CPU_OMP_THREADS_BIND`` listing one core set per rank, and each rank an ``LLM`` over its own
prompts.

The DP+EP tests and ``benchmarks/vllm_dp.py`` share it. Every rank runs in its own process group; `run_dp` kills
each group it started when it returns or raises (a killed run leaves no engine holding a port), and waits with a
deadline. ``python -m tbo.harness.vllm_dp SPEC_JSON`` is the rank's side.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from tbo.harness.launch import free_port

__all__ = ["RankRun", "describe_failure", "run_dp", "start_rank", "stop"]

_RESULT = "TBO_DP_RESULT "
#: a line that says why a rank failed, and the prefix vLLM's logger puts before it
_CAUSE = re.compile(r"(Error|Exception|Killed|Segmentation|core dumped|timed out|deadline)")
_LOG_PREFIX = re.compile(r"^\([^)]*\)\s+(ERROR|WARNING|INFO)\s+\S+ \S+ \[[^]]*\]\s*")


@dataclass
class RankRun:
    """One DP rank's process and, once it exited, what it printed."""

    rank: int
    proc: subprocess.Popen
    stdout: str = ""
    stderr: str = ""
    result: dict[str, Any] | None = None
    returncode: int | None = None
    elapsed_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def tail(self, n: int = 4000) -> str:
        return f"--- rank {self.rank} rc={self.returncode}\n{self.stdout[-n:]}\n{self.stderr[-n:]}"

    def causes(self, limit: int = 12) -> list[str]:
        """The lines of its output that say why it failed (errors, exceptions, signals, time-outs), each once and
        in order, at most ``limit`` (the last ones): a CI log that cuts a long tail still shows each rank's cause."""
        seen: dict[str, None] = {}
        for line in (self.stdout + "\n" + self.stderr).splitlines():
            text = _LOG_PREFIX.sub("", line).strip()
            if _CAUSE.search(text) and not text.startswith(("File ", "^")):
                seen.setdefault(text[:400])
        found = list(seen)[-limit:]
        if self.returncode is not None and self.returncode < 0:
            found.append(f"killed by signal {-self.returncode}")
        if self.extra.get("timed_out"):
            found.append("did not exit within its deadline")
        return found


def describe_failure(runs: Sequence[RankRun], n: int = 3000) -> str:
    """A failed DP run, for an assertion or an error: first every rank's exit code and causes (`RankRun.causes`),
    then each rank's output tail. One rank's crash shows in its peers as "the peer is gone"; the first part names
    the rank that went first even where a log is cut."""
    head = [f"rank {r.rank} rc={r.returncode}: " + (" | ".join(r.causes()) or "no error line") for r in runs]
    return "\n".join(head + [r.tail(n) for r in runs])


def start_rank(rank: int, size: int, port: int, spec: dict[str, Any], binds: str = "0|1",
               env: dict[str, str] | None = None, local_rank: int | None = None) -> RankRun:
    """Start DP rank ``rank`` of ``size`` (its own process group) running ``spec`` (see `_rank_main`).
    ``local_rank``: its index on its node (default ``rank``: every rank on one node); a node of its own is
    ``local_rank=0`` with ``binds`` naming that node's one core set, as vLLM's multi-node example launches it."""
    local = rank if local_rank is None else local_rank
    child = {**os.environ, **(env or {}), "VLLM_DP_RANK": str(rank), "VLLM_DP_RANK_LOCAL": str(local),
             "VLLM_DP_SIZE": str(size), "VLLM_DP_MASTER_IP": "127.0.0.1", "VLLM_DP_MASTER_PORT": str(port),
             "VLLM_CPU_OMP_THREADS_BIND": binds, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    # output to files, not pipes: the rank's engine processes inherit them, and a pipe would stay open (and a
    # reader blocked) for as long as any of them lives
    out = tempfile.NamedTemporaryFile("w+", prefix=f"tbo-dp{rank}-", suffix=".out", delete=False)
    err = tempfile.NamedTemporaryFile("w+", prefix=f"tbo-dp{rank}-", suffix=".err", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "tbo.harness.vllm_dp", json.dumps(spec)], env=child,
                            stdout=out, stderr=err, text=True, start_new_session=True)
    return RankRun(rank, proc, extra={"files": (out, err)})


def stop(run: RankRun, sig: int = signal.SIGKILL) -> None:
    """Signal ``run``'s whole process group (the rank and any engine process it started)."""
    try:
        os.killpg(run.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(run: RankRun, grace_s: float) -> None:
    """Give the rank's engine and worker processes ``grace_s`` to finish shutting down (they write ``stats_file``
    then), and kill what is left of the group."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(run.proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)
    stop(run)


def collect(run: RankRun, timeout_s: float, grace_s: float = 120.0) -> RankRun:
    """Wait for ``run``'s process at most ``timeout_s``, then for its group's engine processes a short grace, kill
    what is left, and read its output."""
    t0 = time.monotonic()
    try:
        run.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        run.extra["timed_out"] = True
    _reap(run, grace_s=grace_s)  # its engine processes finish shutting down (stats_file), or go with the group
    if run.proc.poll() is None:
        run.proc.wait(10)
    run.elapsed_s = time.monotonic() - t0
    run.returncode = run.proc.returncode
    out, err = run.extra["files"]
    for f in (out, err):
        f.flush()
        f.seek(0)
    run.stdout, run.stderr = out.read(), err.read()
    for f in (out, err):
        f.close()
        os.unlink(f.name)
    lines = [line for line in run.stdout.splitlines() if line.startswith(_RESULT)]
    if lines:
        run.result = json.loads(lines[-1][len(_RESULT):])
    return run


def run_dp(specs: Sequence[dict[str, Any]], timeout_s: float = 600.0, env: dict[str, str] | None = None,
           binds: str = "0|1") -> list[RankRun]:
    """Run one process per spec (DP rank k runs ``specs[k]``) and wait for all; every process group is killed
    before this returns, also when it raises."""
    port = free_port()
    runs = []
    try:
        runs = [start_rank(k, len(specs), port, spec, binds, env) for k, spec in enumerate(specs)]
        deadline = time.monotonic() + timeout_s
        for run in runs:
            collect(run, max(1.0, deadline - time.monotonic()))
        return runs
    finally:
        for run in runs:
            stop(run)
            if run.proc.poll() is None:
                run.proc.wait(10)
            for f in run.extra.get("files", ()):
                if not f.closed:
                    f.close()
                    os.unlink(f.name)


# ---- the rank's side ----------------------------------------------------------------------------------------------


def _rank_main(spec: dict[str, Any]) -> None:
    """One DP rank: an ``LLM`` with ``spec["engine"]`` (and ``additional_config["tbo"]`` when ``spec["tbo"]`` is
    not None), then each of ``spec["rounds"]`` (lists of token prompts) generated greedily with
    ``spec["max_tokens"]`` (one count, or one per round); prints one result line with the tokens, the seconds per round
    and, with ``spec["logprobs"]``, each position's top ``[token, log-probability]`` pairs. With ``spec["stagger_s"]``
    each round's first request goes ``stagger_s`` before the others (`_staggered`).

    Every rank must bring requests to every round: offline (no DP coordinator), an engine with none does not wake
    for its peers' wave of steps, and they would wait for it until tbo's deadline. A rank with an empty round
    submits one placeholder request instead, as vLLM's example does (its round's tokens: ``[]``). Within a round, a
    rank whose requests finish first runs dummy steps until its peers' finish; ``generate`` returns when the wave
    ends on every rank (vLLM's offline DP front end waits for its engine's wave to complete)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra: dict[str, Any] = {}
    if spec.get("tbo") is not None:
        extra["additional_config"] = {"tbo": spec["tbo"]}
    llm = LLM(model=spec["model"], **spec.get("engine", {}), **extra)
    max_tokens = spec.get("max_tokens", 6)
    rounds, seconds, top = [], [], []
    for k, prompts in enumerate(spec["rounds"]):
        n = max_tokens[k] if isinstance(max_tokens, list) else max_tokens
        params = SamplingParams(temperature=0, max_tokens=int(n), detokenize=False, ignore_eos=True,
                                logprobs=spec.get("logprobs"))
        _barrier(spec, f"round{k}", float(spec.get("barrier_s", 300)))  # every rank submits its round together
        print(f"TBO_DP_ROUND {k}", flush=True)
        t0 = time.perf_counter()
        if prompts and spec.get("stagger_s"):
            outs = _staggered(llm, [TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                              float(spec["stagger_s"]))
        elif prompts:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        else:  # a placeholder request, as vLLM's example gives an empty rank: its engine then steps with its peers
            llm.generate([TokensPrompt(prompt_token_ids=[1])], SamplingParams(max_tokens=1, detokenize=False),
                         use_tqdm=False)
            outs = []
        seconds.append(time.perf_counter() - t0)
        rounds.append([list(o.outputs[0].token_ids) for o in outs])
        print(f"TBO_DP_ROUND_TOKENS {k} {json.dumps(rounds[-1])}", flush=True)  # read even if a later round fails
        if spec.get("logprobs"):  # per round, request and position: [token, log-probability] pairs, best first
            top.append([[sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda p: -p[1])
                         for pos in o.outputs[0].logprobs] for o in outs])
    print(_RESULT + json.dumps({"tokens": rounds, "seconds": seconds, "logprobs": top}), flush=True)
    _barrier(spec, "done", float(spec.get("barrier_s", 300)))
    llm.llm_engine.engine_core.shutdown()


def _staggered(llm: Any, prompts: list[Any], params: Any, stagger_s: float) -> list[Any]:
    """What ``llm.generate(prompts, params)`` returns, the first request submitted ``stagger_s`` before the others
    (its engine then steps it alone while they arrive): how a front end's one-by-one submission looks to the
    engine under load, made wide enough to test."""
    engine = llm.llm_engine
    ids = [f"staggered-{k}" for k in range(len(prompts))]
    engine.add_request(ids[0], prompts[0], params)
    time.sleep(stagger_s)
    for rid, prompt in zip(ids[1:], prompts[1:]):
        engine.add_request(rid, prompt, params)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[rid] for rid in ids]


def _barrier(spec: dict[str, Any], name: str, timeout_s: float) -> None:
    """Wait until every rank reached ``name``. Before each round: the ranks submit their requests together, so
    that the test's uneven loads are what the steps see. Before shutdown: an idle rank's engine still runs dummy
    steps for its peers' batches (every dispatch needs every rank), so it must not go before they finish."""
    folder = spec.get("barrier_dir")
    if not folder:
        return
    rank, size = int(os.environ["VLLM_DP_RANK"]), int(os.environ["VLLM_DP_SIZE"])
    open(os.path.join(folder, f"{name}-{rank}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(os.path.join(folder, f"{name}-{k}")) for k in range(size)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"DP rank {rank}: the other ranks did not reach {name!r} within {timeout_s:g}s")
        time.sleep(0.02)


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
