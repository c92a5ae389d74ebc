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
    assert max_diff(out) == 0.0
    assert re.search(r"single: [\d.]+ ms\s+TBO: [\d.]+ ms\s+speedup: [\d.]+x", out)
    assert "round | microbatch A" in out


@pytest.mark.dist
@pytest.mark.parametrize("ranks", [2, 3])
def test_deepseek_prefill_multi_rank_with_link(ranks):
    out = run("deepseek_prefill.py", "--ranks", str(ranks), "--link", "50,0.05", *SMALL)
    assert max_diff(out) == 0.0
    assert f"ranks: {ranks}" in out and "link: busy" in out


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
    assert max_diff(out) < 1e-5 and "tokens equal: True" in out
