"""The example scripts run as users run them (subprocesses), and say what they promise."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--seqs", "4", "--ctx", "8", "--layers", "2", "--repeats", "1"]


def run(script, *args, timeout=300):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def max_diff(out):
    return float(re.search(r"^max diff: (\S+)", out, re.M).group(1))


def assert_split(out):
    """The example says its steps were split: its max diff compares TBO, not one batch, with forward()."""
    assert re.search(r"\bsplit: yes\b", out), f"the example was not split:\n{out[-1500:]}"


def test_minimal_example():
    out = run("minimal.py")
    assert "overlapped == each microbatch alone: True" in out


def test_custom_strategy_example():
    out = run("custom_strategy.py")
    assert max_diff(out) < 1e-5
    assert "strategy parallel_block: 4 stages, delta_stages=1" in out and "microbatch C" in out


@pytest.mark.parametrize("script", ["deepseek_decode.py", "deepseek_prefill.py"])
def test_deepseek_examples_one_process(script):
    out = run(script, *SMALL)
    assert_split(out)
    assert max_diff(out) == 0.0
    assert re.search(r"single: [\d.]+ ms\s+TBO: [\d.]+ ms\s+speedup: [\d.]+x", out)
    assert "round | microbatch A" in out


@pytest.mark.dist
@pytest.mark.parametrize("ranks", [2, 3])
def test_deepseek_prefill_multi_rank_with_link(ranks):
    out = run("deepseek_prefill.py", "--ranks", str(ranks), "--link", "50,0.05", *SMALL)
    assert_split(out)
    assert max_diff(out) == 0.0 and f"ranks: {ranks}" in out
    # 2 layers, the first dense: one MoE layer's dispatch and combine, once per microbatch (one batch: 2)
    assert re.search(r"^link: 4 transfers per TBO step, busy [\d.]+ ms", out, re.M), out[-1500:]


def test_decode_example_says_when_a_step_is_not_split():
    """One sequence cannot be split for decode: the example says so, and claims no speedup."""
    out = run("deepseek_decode.py", "--seqs", "1", "--ctx", "8", "--layers", "2", "--repeats", "1")
    assert "split: no (a rank's step is below SplitPolicy's thresholds, 2 decode" in out
    assert "speedup: none (not split, nothing overlapped)" in out and max_diff(out) == 0.0


@pytest.mark.dist
def test_afd_example():
    out = run("afd_dbo.py", "--repeats", "1")
    diffs = [float(v) for v in re.findall(r"^max diff: (\S+)", out, re.M)]
    assert diffs == [0.0, 0.0]
    assert out.count("speedup:") == 2 and "split into 2 microbatches: yes" in out


@pytest.mark.dist
@pytest.mark.parametrize("model,ranks", [("deepseek_v3", "1"), ("qwen3_moe", "2")])
def test_hf_generate_example(model, ranks):
    pytest.importorskip("transformers", reason="the hf extra (transformers 5.x) is not installed")
    out = run("hf_generate.py", "--model", model, "--ranks", ranks, "--new-tokens", "8")
    assert_split(out)
    assert max_diff(out) < 1e-5 and "tokens equal: True" in out


def test_integrating_example_one_process(tmp_path):
    """docs/integrating.md's worked example: a user's MoE layer, a cut prefill then decode, equal within 1e-5."""
    png, saved = tmp_path / "timeline.png", tmp_path / "moe.json"
    out = run("integrating.py", "--png", str(png), "--save-strategy", str(saved))
    assert max_diff(out) <= 1e-5
    assert "prefill 132 tokens, 2 microbatches, request 1 cut 59|61" in out  # the cut falls inside a sequence
    assert "decode 3 tokens, 2 microbatches" in out and "lint my_moe: 0 error(s)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the strategy file shipped for `tbo simulate` is the example's strategy
    assert saved.read_text() == (ROOT / "examples" / "integrating_moe.json").read_text()


@pytest.mark.dist
def test_integrating_example_two_ranks():
    out = run("integrating.py", "--ranks", "2")
    assert max_diff(out) <= 1e-5 and "ranks: 2" in out
    assert "rank 1: prefill 135 tokens, 2 microbatches, request 1 cut" in out


def test_shipped_costs_file_drives_tbo_simulate(capsys):
    """examples/costs.json is what `tbo simulate --costs` reads: every op it prices is in the example's strategy,
    every transfer it sizes is one the strategy makes, and the CLI runs on it."""
    from tbo.core.strategy import OperationsStrategy
    from tbo.tools.cli import main
    from tbo.tools.simulate import CostModel

    costs = CostModel.model_validate_json((ROOT / "examples" / "costs.json").read_text())
    strategy = OperationsStrategy.model_validate_json((ROOT / "examples" / "integrating_moe.json").read_text())
    names = {name for stage in strategy.stage_names for name in stage}
    assert set(costs.ops) <= names and {"table", "roofline", "linear", "constant"} <= {c.kind for c in
                                                                                     costs.ops.values()}
    assert set(costs.transfers) == {costs.role(n)[1] for n in names if costs.role(n)}
    for tokens, faster in (("16", False), ("4096", True)):  # fragmentation loses small, overlap wins large
        assert main(["simulate", str(ROOT / "examples" / "integrating_moe.json"), "--tokens", tokens, "--costs",
                     str(ROOT / "examples" / "costs.json"), "--layers", "4"]) == 0
        speedup = float(re.search(r"^speedup: ([\d.]+)x", capsys.readouterr().out, re.M).group(1))
        assert (speedup > 1) is faster


def test_integrating_guide_names_exist():
    """Every `tbo.…` name and every examples/ file the guide mentions exists, so the guide cannot rot silently."""
    import importlib

    text = (ROOT / "docs" / "integrating.md").read_text()
    for path in set(re.findall(r"examples/[\w.]+\.(?:py|json)", text)):
        assert (ROOT / path).is_file(), path
    names = set(re.findall(r"`(tbo(?:\.\w+)+)", text))
    assert len(names) > 10
    for dotted in sorted(names):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            break
        else:
            raise AssertionError(f"{dotted} does not import")


def test_tiny_engine_on_the_engine_kit():
    """docs/integrating.md's third engine: tbo in a small continuous-batching engine through the engine kit alone.
    Its tokens equal the engine's own, and steps of every kind were split (else the equality proves nothing); closing
    restores the engine's seam and leaves the kit's registry empty."""
    out = run("tiny_engine.py")
    assert "tokens: equal" in out, out
    split = re.search(r"^steps: (\d+), split: (\d+), microbatches: (\d+), cut requests: (\d+)", out, re.M)
    assert split and int(split[2]) > 0 and int(split[4]) > 0, out
    for mode in ("decode", "prefill", "mixed"):
        assert re.search(rf"{mode} [1-9]\d*/\d+", out), f"no split {mode} step:\n{out}"
    assert re.search(r"^tbo: \d+ of \d+ forward steps overlapped", out, re.M), out
    assert "run_layers restored: True, registry: 0" in out, out
    unsplit = int(split[1]) - int(split[2])  # each says why: here, under the thresholds the example sets
    assert f"unsplit by reason: below_threshold {unsplit}" in out, out


def test_tiny_engine_adaptive_over_a_link_replans_through_the_kit():
    """split 'adaptive' with microbatches [2, 3] over an emulated link: the kit's driver chooses, the glue re-plans
    (decide_facts with the chosen count's policy), the tokens stay the engine's own. The warm-up explores splits in
    the buckets it meets (a link gives the steps transfers to hide), so some steps split: else nothing ran."""
    out = run("tiny_engine.py", "--config",
              '{"split": "adaptive", "adaptive": {"microbatches": [2, 3]}, "link": "2000,0.05"}')
    assert "tokens: equal" in out, out
    split = re.search(r"^steps: (\d+), split: (\d+), microbatches: (\d+)", out, re.M)
    assert split and int(split[2]) > 0, out
    assert re.search(r"^adaptive: .*tokens: ", out, re.M), out


@pytest.mark.parametrize("config, named", [
    ('{"afd": {"ffn": "127.0.0.1:9"}}', "afd="),
    ('{"num_microbatch": 3}', "unknown key 'num_microbatch'"),
    ('{"strategy": "qwen3_moe_decode"}', "cannot bind strategy qwen3_moe_decode to MyMoELayer"),
])
def test_tiny_engine_refuses_what_it_cannot_run_by_name(config, named):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_engine.py"), "--config", config],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "refused: " in proc.stderr and named in proc.stderr, proc.stderr[-2000:]
