import json
import subprocess
import sys

import pytest

from tbo import OperationsStrategy, Yield
from tbo.cli import main


@pytest.fixture
def strategy_file(tmp_path):
    s = OperationsStrategy(operations=["attn", Yield, "dispatch_a", Yield, "dispatch_b", "experts", Yield,
                                       "combine_b"], delta_stages=1, name="mini")
    path = tmp_path / "mini.json"
    path.write_text(s.model_dump_json())
    return path


def test_show_prints_stages_and_schedule(strategy_file, capsys):
    assert main(["show", str(strategy_file)]) == 0
    out = capsys.readouterr().out
    assert "strategy mini: 4 stages, delta_stages=1" in out
    assert "stage 2: dispatch_b, experts" in out
    assert "schedule: 2 microbatches, delta_stages=1, 5 rounds" in out
    lines = out.splitlines()
    row = next(l for l in lines if l.startswith("1 "))
    assert "s1 dispatch_a" in row and "s0 attn" in row


def test_show_delta_and_microbatches(strategy_file, capsys):
    assert main(["show", str(strategy_file), "--delta", "0", "--microbatches", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 microbatches, delta_stages=0, 4 rounds" in out and "microbatch C" in out


def test_show_bad_file_exits_nonzero(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"operations": ["a", "Yield"]}))
    assert main(["show", str(bad)]) == 2
    assert "operations[1] is Yield at the end" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "missing.json")]) == 2


def test_console_script_module_entry(strategy_file):
    out = subprocess.run([sys.executable, "-m", "tbo", "show", str(strategy_file)], capture_output=True,
                         text=True, check=True).stdout
    assert "schedule:" in out
