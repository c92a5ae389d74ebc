import json
import subprocess
import sys

import pytest

from tbo import OperationsStrategy, Yield
from tbo.tools.cli import main


@pytest.fixture
def strategy_file(tmp_path):
    s = OperationsStrategy(operations=["attn", Yield, "dispatch_a", Yield, "dispatch_b", "experts", "combine_a",
                                       Yield, "combine_b"], delta_stages=1, name="mini")
    path = tmp_path / "mini.json"
    path.write_text(s.model_dump_json())
    return path


def test_show_prints_stages_and_schedule(strategy_file, capsys):
    assert main(["show", str(strategy_file)]) == 0
    out = capsys.readouterr().out
    assert "strategy mini: 4 stages, delta_stages=1" in out
    assert "stage 2: dispatch_b, experts, combine_a" in out
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


def test_show_by_registered_name(capsys):
    assert main(["show", "deepseek_decode"]) == 0
    out = capsys.readouterr().out
    assert "strategy deepseek_decode: 6 stages, delta_stages=2" in out
    assert main(["show", "no_such_strategy"]) == 2
    assert "neither a strategy JSON file nor a registered strategy" in capsys.readouterr().err


def test_simulate_command(tmp_path, capsys):
    from tbo.tools.simulate import Cost, CostModel, TransferCost

    costs = CostModel(ops={"attn_core": Cost(per_token=1e-4), "experts": Cost(per_token=1e-4)},
                      transfers={"dispatch": TransferCost(bytes_per_token=1e3), "combine": TransferCost(
                          bytes_per_token=1e3)}, latency_s=1e-5, bandwidth=1e7)
    path = tmp_path / "costs.json"
    path.write_text(costs.model_dump_json())
    png, trace = tmp_path / "sim.png", tmp_path / "sim.json"
    assert main(["simulate", "deepseek_decode", "--tokens", "64", "--costs", str(path), "--layers", "3",
                 "--png", str(png), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "single:" in out and "TBO:" in out and "speedup:" in out and "lower bound" in out
    assert png.exists() and json.loads(trace.read_text())["traceEvents"]


def test_simulate_missing_costs_file_names_it(tmp_path, capsys):
    assert main(["simulate", "deepseek_decode", "--tokens", "64", "--costs", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tbo simulate: error:") and "nope.json" in err and "Traceback" not in err
