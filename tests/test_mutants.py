"""The suite can fail: equivalence tests run under the never-split mutant fail, and pass without it.

A test comparing TBO with ``forward()`` passes just as well when nothing is ever split, unless it also checks that
the split happened (`split_witness.SplitWitness`, an example's ``split: yes``). `tests/mutants/never_split` makes
`SplitPolicy.plan` return None in every process; here pytest runs a few representative equivalence tests in a
subprocess with it on PYTHONPATH and expects each to fail for that reason, in this process, in the ranks `launch`
spawns, in HF generation, and in an example script and its ranks. A control run without the mutant must pass, so
the failures are the mutant's. (The whole list of tests the mutant fails is in the commit that added this file;
run ``PYTHONPATH=tests/mutants/never_split:. pytest tests/test_models.py ...`` to repeat it.)
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NEVER_SPLIT = ROOT / "tests" / "mutants" / "never_split"
REPRESENTATIVE = [
    "tests/test_models.py::test_ops_and_tbo_equal_forward_bit_exact[lens0-deepseek]",  # this process
    "tests/test_models.py::test_two_ranks_expert_parallel[expanded]",  # ranks spawned by launch()
    "tests/test_hf.py::test_greedy_generation_equals_hf[qwen3_moe]",  # the HF integration
    "tests/test_examples.py::test_deepseek_examples_one_process[deepseek_decode.py]",  # a script and its rank
]


def start_pytest(tmp_path, name, mutant):
    """pytest running REPRESENTATIVE in a subprocess, with the mutant on PYTHONPATH or without; its report path."""
    report = tmp_path / f"{name}.xml"
    paths = [str(NEVER_SPLIT)] * mutant + [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                             *REPRESENTATIVE], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    return proc, report


def outcomes(proc, report):
    """Outcome per test id: "passed", or the failure's (or error's, or skip's) text."""
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert report.exists(), out[-3000:]
    result = {}
    for case in ET.parse(report).iter("testcase"):
        test_id = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
        problems = [el for el in case if el.tag in ("failure", "error", "skipped")]
        result[test_id] = "passed" if not problems else f"{problems[0].tag}: {problems[0].text or ''}"
    assert sorted(result) == sorted(REPRESENTATIVE), out[-3000:]
    return result


@pytest.mark.dist
def test_equivalence_tests_fail_when_nothing_is_split(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra (transformers 5.x) is not installed")
    runs = [start_pytest(tmp_path, "never_split", mutant=True)]  # both at once: most of their time is startup
    try:
        runs.append(start_pytest(tmp_path, "control", mutant=False))
        mutant, control = (outcomes(*run) for run in runs)
    finally:
        for proc, _ in runs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for test_id, outcome in mutant.items():
        assert outcome.startswith("failure: "), f"{test_id} passes with nothing ever split ({outcome[:200]})"
        assert "not split" in outcome, f"{test_id} failed under the mutant, but not for the split:\n{outcome}"
    for test_id, outcome in control.items():
        assert outcome == "passed", f"{test_id} fails without the mutant too:\n{outcome}"
