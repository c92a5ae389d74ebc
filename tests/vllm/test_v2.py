"""tbo on vLLM's Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``), run here under Triton's interpreter.

The V2 engines run in one process of their own (tests/vllm/v2_engine.py, with the Triton shims of tests/triton_site
on its path only: they must never reach a V1 engine), one after the other, shared by every test here through the
module-scoped `v2` fixture: plain V2, tbo at 2 and at 3 microbatches, tbo over an emulated link, the engines tbo
must refuse on V2, and tbo with its FFN on an AFD server (``tbo afd-ffn``, a subprocess) beside a plain fp32
engine. The interpreter costs about 0.15 s a step, so the scenarios are short.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import (ENGINE, SCENARIOS, TBO, FfnServer, _assert_remote, _free, _generate, _llm, _prompt, _tokens,
                      needs_vllm)

pytestmark = needs_vllm

#: name -> (prompts, max_tokens): a prefill step then decode steps; a prefill cut between requests; one prompt cut
#: inside (two-chunk); a long prompt chunked beside decodes (mixed steps); prompts behind one prefix under prefix
#: caching, some admitted on a cache hit against blocks another request of the same step writes (helpers.SCENARIOS)
RUNS = {
    "decode": (SCENARIOS["decode"], 4),
    "prefill": (SCENARIOS["prefill"], 2),
    "cut": (SCENARIOS["cut"], 2),
    "mixed": ([_prompt(4, 9), _prompt(5, 10), _prompt(50, 11)], 3),
    "shared_prefix": (SCENARIOS["shared_prefix"], 1),
}

#: microbatches -> tbo's config (a decode step of 3 tokens gives each of 3 microbatches one). With ``op_times`` every
#: step runs tbo's layer loop; without it (3), unsplit steps run vLLM's own forward (runner/forwards.py)
SPLIT = {2: {**TBO, "num_microbatches": 2},
         3: {**TBO, "num_microbatches": 3, "decode_token_threshold": 3, "op_times": False}}

#: an emulated link (10 us, 100 GB/s) under tbo's local backend, and the runs it makes (every step through tbo's loop)
LINK = {**TBO, "link": "10,100"}
LINK_RUNS = ("decode", "mixed")

#: what tbo does not run on V2 yet, each refused at engine start: name -> (engine settings, tbo config, culprit)
REFUSED = {
    "compiled": ({"enforce_eager": False}, TBO, "enforce_eager=False"),
    "speculative": ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                            "prompt_lookup_max": 2}}, TBO, "speculative_config='ngram'"),
    "deepep": ({}, {**TBO, "backend": "deepep"}, "backend='deepep'"),
}
#: AFD (its FFN on a ``tbo afd-ffn`` server), judged in fp32 by a plain fp32 engine (the server computes in fp32)
AFD_DTYPE = "float32"


@pytest.fixture(scope="module")
def v2(qwen3_moe: Path, tmp_path_factory) -> dict[str, dict]:
    """Every V2 engine of this module, run once: ``"plain"``, ``2`` and ``3`` (tbo's microbatches), and each of
    `REFUSED`'s names."""
    from .v2_engine import run_v2

    engine = {**ENGINE, "model": str(qwen3_moe)}
    runs = [{"prompts": prompts, "max_tokens": n} for prompts, n in RUNS.values()]
    names: list = ["plain", *SPLIT, "link", *REFUSED, "plain_fp32", "afd"]
    items = [{"engine": engine, "tbo": None, "runs": runs}]
    items += [{"engine": engine, "tbo": tbo, "runs": runs} for tbo in SPLIT.values()]
    items += [{"engine": engine, "tbo": LINK, "runs": [runs[list(RUNS).index(name)] for name in LINK_RUNS]}]
    items += [{"engine": {**engine, **kw}, "tbo": tbo, "runs": []} for kw, tbo, _ in REFUSED.values()]
    fp32 = {**engine, "dtype": AFD_DTYPE}
    server = FfnServer(qwen3_moe, AFD_DTYPE)
    try:
        items += [{"engine": fp32, "tbo": None, "runs": runs},
                  {"engine": fp32, "tbo": {**TBO, "afd": {"ffn": server.address}}, "runs": runs}]
        results = dict(zip(names, run_v2(tmp_path_factory.mktemp("v2"), items)))
        rc, out, err = server.finish()  # the attention side's process has ended: the server exits
        results["afd_server"] = {"rc": rc, "out": out, "err": err[-3000:]}
    finally:
        server.kill()
    return results


def _runs(result: dict) -> dict[str, dict]:
    assert "error" not in result, result["error"]
    return dict(zip(RUNS, result["runs"]))


def test_plain_v2_runs_here_and_equals_v1(v2, qwen3_moe):
    """The shims run V2 here: its runner is V2's CPU runner, and its tokens are plain V1's."""
    plain = v2["plain"]
    assert plain.get("runner") == "vllm.v1.worker.cpu.model_runner.CPUModelRunner", plain
    assert not plain["tbo"]
    llm = _llm(qwen3_moe)  # V1: this process has no shim
    try:
        from .helpers import _runner

        assert type(_runner(llm)).__module__ == "vllm.v1.worker.cpu_model_runner"
        for name, run in _runs(plain).items():
            prompts, n = RUNS[name]
            assert _tokens(_generate(llm, prompts, max_tokens=[n] * len(prompts))) == run["tokens"], name
    finally:
        _free(llm)


@pytest.mark.parametrize("microbatches", list(SPLIT))
def test_v2_splits_with_tokens_equal_plain_v2(v2, microbatches):
    """With V2 selected, an engine given tbo's config splits its decode and prefill steps (a request cut inside, a
    mixed step) at 2 and 3 microbatches, with the tokens of plain V2: tbo's counters say so, not silence."""
    result, plain = v2[microbatches], _runs(v2["plain"])
    assert result["tbo"], "tbo is not installed on V2's runner"
    for name, run in _runs(result).items():
        s = run["stats"]
        assert run["tokens"] == plain[name]["tokens"], (name, microbatches)
        assert s["split_steps"] > 0 and s["microbatches"] == microbatches * s["split_steps"], (name, s)
    by_run = {name: run["stats"] for name, run in _runs(result).items()}
    assert by_run["decode"]["split_steps_by_mode"]["decode"] == RUNS["decode"][1] - 1  # every decode step
    assert by_run["decode"]["split_steps_by_mode"]["prefill"] == 1
    assert by_run["prefill"]["split_steps_by_mode"]["prefill"] == 1
    assert by_run["cut"]["cut_requests"] >= 1  # the 30-token prompt was cut inside
    assert by_run["mixed"]["split_steps_by_mode"]["mixed"] >= 1
    # V2 has no prefix-cache veto of its own: tbo's (readers_last) kept some steps whole, and the tokens held
    assert result["runs"][list(RUNS).index("shared_prefix")]["vetoes"] > 0


def test_v2_runs_an_emulated_link(v2):
    """``link`` on V2: the expert traffic of tbo's local backend booked on an emulated link (`EmulatedLink`), its
    steps split, tokens equal plain V2's."""
    result, plain = v2["link"], _runs(v2["plain"])
    assert "error" not in result, result["error"]
    assert result["tbo"] and result["links"] == ["EmulatedLink"] and result["booked_s"] > 0, result
    for name, run in zip(LINK_RUNS, result["runs"]):
        assert run["tokens"] == plain[name]["tokens"], name
        assert run["stats"]["split_steps"] > 0, (name, run["stats"])


def test_v2_runs_afd_with_every_ffn_on_the_server(v2):
    """AFD on V2: every layer of every stage of every step (each microbatch of a split one) sends its FFN to the
    server and none runs here; tokens equal plain V2's in fp32 (the server computes in fp32);
    the server exits 0 when the engine's process ends, having served every stage sent."""
    result, plain = v2["afd"], _runs(v2["plain_fp32"])
    assert result["tbo"], result
    sent = 0
    for name, run in _runs(result).items():
        s = run["stats"]
        assert run["tokens"] == plain[name]["tokens"], name
        assert s["split_steps"] > 0, (name, s)
        _assert_remote(s, 3)
        sent += s["afd_stages_sent"]
    server = v2["afd_server"]
    assert server["rc"] == 0, server["err"]
    assert f"the attention side shut down; served {sent} requests (" in server["out"], server["out"]


@pytest.mark.parametrize("name", list(REFUSED))
def test_v2_refuses_what_it_cannot_run_by_name(v2, name):
    """What tbo does not run on V2 yet refuses the engine at start, naming the setting, V2's runner, the vLLM
    version and the way out."""
    import vllm

    culprit = REFUSED[name][2]
    error = v2[name].get("error")
    assert error is not None, f"{name}: the engine started on V2 ({v2[name]})"
    assert error.startswith("TboConfigError: "), error
    assert f"additional_config['tbo'] with {culprit}: not supported" in error, error
    assert f"vLLM {vllm.__version__}'s Model Runner V2 (vllm.v1.worker.cpu.model_runner.CPUModelRunner)" in error
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in error, error


def test_v2_refuses_data_parallelism_by_name_and_admits_tensor_parallelism(qwen3_moe):
    """Data parallelism (DP attention + EP) refused on V2 by the same check the engine runs before its weights load,
    on vLLM's own config of such an engine (its engines need processes of their own); tensor parallelism, with the
    thresholds or the adaptive split, admitted (tests/vllm/test_v2_tp.py runs it)."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner

    from tbo.integrations.vllm.admit.runners import check_v2
    from tbo.integrations.vllm.config import TboConfigError, parse_config

    def vllm_config(**kw):
        return EngineArgs(model=str(qwen3_moe), skip_tokenizer_init=True, enforce_eager=True, max_model_len=256,
                          **kw).create_engine_config()

    config = parse_config({"tbo": TBO})
    with pytest.raises(TboConfigError) as e:
        check_v2(CPUModelRunner, vllm_config(data_parallel_size=2, enable_expert_parallel=True), config,
                 vllm.__version__)
    assert "additional_config['tbo'] with data_parallel_size=2: not supported" in str(e.value), e.value
    assert "Model Runner V2 (vllm.v1.worker.cpu.model_runner.CPUModelRunner)" in str(e.value)
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in str(e.value)
    for tbo in (TBO, {**TBO, "split": "adaptive"}):
        check_v2(CPUModelRunner, vllm_config(tensor_parallel_size=2), parse_config({"tbo": tbo}), vllm.__version__)
    # a link under TP (it carries the all-reduces too: tests/vllm/test_v2_tp.py's MoE engine runs over one)
    check_v2(CPUModelRunner, vllm_config(tensor_parallel_size=2), parse_config({"tbo": LINK}), vllm.__version__)


def test_every_model_runner_class_is_wrapped_or_refused():
    """Every model runner class this vLLM ships (V1 and V2, GPU, CPU, XPU, encoder-only) runs tbo's checks where its
    weights load: the plugin wrapped its ``load_model``, its own or inherited; and a runner of neither kind is refused
    by name."""
    import importlib
    import inspect
    import pkgutil

    import vllm
    import vllm.v1.worker as worker

    from tbo.integrations.vllm.admit.runners import runner_kind
    from tbo.integrations.vllm.config import TboConfigError
    from tbo.integrations.vllm.plugin import register

    register()
    found = []
    for info in pkgutil.walk_packages(worker.__path__, "vllm.v1.worker."):
        if "model_runner" not in info.name:
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # a platform's runner whose kernels this build lacks
            continue
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and name.endswith(("ModelRunner", "ModelRunnerV2")) \
                    and hasattr(cls, "load_model"):
                found.append(f"{info.name}.{name}")
                assert getattr(cls.load_model, "__tbo_wrapped__", False), f"{info.name}.{name}.load_model unwrapped"
    assert {"vllm.v1.worker.gpu.model_runner.GPUModelRunner", "vllm.v1.worker.cpu.model_runner.CPUModelRunner",
            "vllm.v1.worker.gpu_model_runner.GPUModelRunner", "vllm.v1.worker.cpu_model_runner.CPUModelRunner",
            "vllm.v1.worker.mm_encoder_model_runner.MMEncoderModelRunner"} <= set(found), found
    with pytest.raises(TboConfigError, match=rf"vLLM {vllm.__version__}'s model runner builtins.object: not supported"):
        runner_kind(object(), vllm.__version__)


def test_every_v2_symbol_tbo_touches_exists_in_this_vllm():
    """`V2_SYMBOLS` (the vLLM contract's V2 entries: every Model Runner V2 name tbo reads, patches or wraps) against
    the installed vLLM, asked of Python where ``make contract`` reads the source: each entry of this release names
    something that imports, a wrapped ``own`` method is the class's own, the parameters tbo passes are its
    signature's (in order where tbo passes them positionally), and a dataclass's or named tuple's fields tbo reads
    are there."""
    import dataclasses
    import importlib
    import inspect

    import vllm

    from tbo.integrations.vllm.contract import release_of
    from tbo.integrations.vllm.runner.v2 import V2_SYMBOLS

    release = release_of(vllm.__version__)
    entries = [e for e in V2_SYMBOLS if release in e.releases]
    assert len(entries) >= 20 and {e.kind for e in entries} == {"wrap", "read", "patch", "call", "import"}
    checked = {"params": 0, "fields": 0}
    for e in entries:
        owner = obj = importlib.import_module(e.module)
        for part in (e.name or "").split(".") if e.name else ():
            owner, obj = obj, (getattr(obj, part) if hasattr(obj, part) or not inspect.ismodule(obj)
                               else importlib.import_module(f"{obj.__name__}.{part}"))
        if e.own:
            assert e.name.split(".")[-1] in owner.__dict__, e.label
        if e.params:
            names = [p for p in inspect.signature(obj).parameters if p != "self"]
            if e.leading:
                assert names[:len(e.params)] == list(e.params), (e.label, names)
            else:
                assert set(e.params) <= set(names), (e.label, names)
            checked["params"] += 1
        if e.kind == "read" and (dataclasses.is_dataclass(obj) or hasattr(obj, "_fields")):
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set(obj._fields)
            assert set(e.attrs) <= fields | set(dir(obj)), (e.label, set(e.attrs) - fields)
            checked["fields"] += 1
    assert checked["params"] >= 12 and checked["fields"] >= 3, checked  # BatchReqState, the descriptor, InputBatch


def test_v2_facts_adapt_batch_req_state():
    """V2's ``BatchReqState`` (decode first, as V2 sorts it) adapted to the `StepFacts` tbo decides on: a reader
    of cached blocks followed by another request keeps the step whole; last, it splits."""
    import numpy as np
    from vllm.v1.worker.gpu.model_runner import BatchReqState

    from tbo.integrations.engine.step import decide_facts
    from tbo.integrations.vllm.runner.v2 import v2_facts
    from tbo.split import SplitPolicy

    def state(scheduled, computed, prefill_len):
        computed, prefill_len = np.array(computed), np.array(prefill_len)
        return BatchReqState(req_ids=[str(i) for i in range(len(scheduled))],
                             num_scheduled_tokens=np.array(scheduled, dtype=np.int32), num_tokens=sum(scheduled),
                             num_draft_tokens_np=None, idx_mapping_np=np.arange(len(scheduled)),
                             prefill_len_np=prefill_len, num_computed_prefill_tokens_np=computed,
                             is_prefilling_np=computed < prefill_len, max_seq_len_np=None,
                             has_prefill=bool((computed < prefill_len).any()), prefill_runs_as_decode_np=None,
                             decode_graph_eligible=False)

    policy = SplitPolicy(num_microbatches=2, decode_token_threshold=2, prefill_token_threshold=12)
    facts = v2_facts(state([1, 1, 20], [5, 7, 0], [5, 7, 20]), 22)
    assert facts.scheduled == (1, 1, 20) and facts.past_prompt == (True, True, False)
    assert facts.computed == (5, 7, 0) and facts.padded_tokens == 22 and facts.drafts is None
    step = decide_facts(policy, facts)
    assert step.kind == "mixed" and step.plan is not None
    reader_first = v2_facts(state([12, 12], [32, 0], [44, 12]), 24)  # a cache hit before a new prompt
    assert decide_facts(policy, reader_first).plan is None
    reader_last = v2_facts(state([12, 12], [0, 32], [12, 44]), 24)
    assert decide_facts(policy, reader_last).plan is not None
