import json
import os
import re
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


def test_a_costs_file_that_is_not_a_regular_file_is_refused_in_one_line(tmp_path, capsys):
    """A FIFO used to block the read forever, /dev/zero to read until memory ran out (issue 45)."""
    fifo = tmp_path / "costs.fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero"):
        assert main(["simulate", "deepseek_decode", "--tokens", "64", "--costs", path]) == 2
        err = capsys.readouterr().err
        assert err == f"tbo simulate: error: costs file {path}: not a regular file\n", err


# ---- what a first-time user met (issue 27) ------------------------------------------------------------------------
@pytest.fixture
def costs_file(tmp_path):
    from tbo.tools.simulate import Cost, CostModel, TransferCost

    costs = CostModel(ops={"attn_core": Cost(per_token=1e-4), "experts": Cost(per_token=1e-4)},
                      transfers={"dispatch": TransferCost(bytes_per_token=1e3), "combine": TransferCost(
                          bytes_per_token=1e3)}, latency_s=1e-5, bandwidth=1e7)
    path = tmp_path / "costs.json"
    path.write_text(costs.model_dump_json())
    return path


@pytest.mark.parametrize("flag", ["--tokens", "--layers"])
def test_simulate_refuses_zero_naming_the_flag(flag, costs_file, capsys):
    """--tokens 0 printed a speedup; --layers 0 said "concat needs at least one strategy"."""
    args = {"--tokens": "64", "--layers": "1", flag: "0"}
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "deepseek_decode", "--costs", str(costs_file), *[x for kv in args.items() for x in kv]])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected a positive integer, got 0" in err and "concat" not in err


def test_simulate_reports_the_mode(costs_file, capsys):
    """A prefill step is reported as prefill: --mode, or a strategy whose name says prefill."""
    base = ["--tokens", "64", "--costs", str(costs_file)]
    assert main(["simulate", "deepseek_prefill", *base]) == 0
    assert re.search(r"^prefill, 64 tokens: TBO hides", capsys.readouterr().out, re.M)
    assert main(["simulate", "deepseek_decode", *base]) == 0
    assert re.search(r"^decode, 64 tokens: TBO hides", capsys.readouterr().out, re.M)
    assert main(["simulate", "deepseek_decode", *base, "--mode", "prefill"]) == 0
    assert re.search(r"^prefill, 64 tokens: TBO hides", capsys.readouterr().out, re.M)


def test_a_closed_pipe_ends_quietly(tmp_path):
    """`tbo predict ... | head -2` ended with "error: [Errno 32] Broken pipe" and exit 2."""
    script = (f"{sys.executable} -m tbo predict step --hardware h800 --model deepseek-v3 --ep 32 "
              "--tokens-per-device 128 --context 4096 | head -2; echo status ${PIPESTATUS[0]} >&2")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.stdout.splitlines()[0].startswith("single_ms: ") and len(out.stdout.splitlines()) == 2
    assert out.stderr.strip() == "status 141", out.stderr  # 128 + SIGPIPE, as a Unix tool killed by it; no message


def test_json_errors_name_the_file_and_read_as_one_line(tmp_path, costs_file, capsys):
    garbage = tmp_path / "garbage.json"
    garbage.write_text('{"a": 1 "b": 2}')
    assert main(["predict", "step", "--hardware", str(garbage), "--model", "deepseek-v3", "--ep", "32",
                 "--tokens-per-device", "128", "--context", "4096"]) == 2
    err = capsys.readouterr().err
    assert f"hardware file {garbage}: not valid JSON, line 1 column 9: Expecting ',' delimiter" in err
    assert main(["simulate", "deepseek_decode", "--tokens", "64", "--costs", str(garbage)]) == 2
    assert f"costs file {garbage}: not valid JSON" in capsys.readouterr().err
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"ops": {"attn": 3}, "latency_s": "soon"}))
    assert main(["simulate", "deepseek_decode", "--tokens", "64", "--costs", str(wrong)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "errors.pydantic.dev" not in err and "validation error" not in err, err
    assert f"costs file {wrong}: field 'ops.attn': " in err and "(got 3)" in err and "field 'latency_s'" in err
    assert main(["show", str(garbage)]) == 2
    assert f"strategy file {garbage}: not valid JSON" in capsys.readouterr().err


def test_show_validates_delta_as_the_constructor_does(capsys):
    """--delta 9 on a 6-stage strategy rendered a schedule the constructor refuses, under a delta_stages=2 header."""
    assert main(["show", "deepseek_decode", "--delta", "9"]) == 2
    err = capsys.readouterr().err
    assert "--delta 9: delta_stages=9 must be less than the number of stages (6)" in err
    assert main(["show", "deepseek_decode", "--delta", "-1"]) == 2
    assert "--delta -1: delta_stages must be >= 0" in capsys.readouterr().err
    assert main(["show", "deepseek_decode", "--delta", "1"]) == 0
    out = capsys.readouterr().out
    assert "strategy deepseek_decode: 6 stages, delta_stages=1" in out and "delta_stages=1, " in out


@pytest.mark.parametrize("argv, costs, message", [
    (["simulate", "deepseek_decode", "--tokens", "8"], "[" * 200_000 + "]" * 200_000, "nested too deeply"),
    (["simulate", "deepseek_decode", "--tokens", "8"], '{"bandwidth": 0}', "field 'bandwidth': Input should be greater than 0"),
    (["simulate", "deepseek_decode", "--tokens", "8"], '{"latency_s": NaN}', "field 'latency_s': Input should be a finite number"),
    (["simulate", "deepseek_decode", "--tokens", "8"], '{"default": {"kind": "constant", "seconds": -1}}', "greater than or equal to 0"),
    (["simulate", "deepseek_decode", "--tokens", "64"],
     '{"transfers": {"dispatch": {"bytes_per_token": 1e308}}}', "bytes_per_token 1e+308) at 64 tokens is inf"),
    (["simulate", "deepseek_decode", "--tokens", "64"],
     '{"default": {"kind": "linear", "per_token": 1e308}}', "at 64 tokens is inf: a coefficient of the costs file"),
    (["lint", "deepseek_decode", "--layers", "100000"], None, "argument --layers: expected at most 1024"),
    (["show", "deepseek_decode", "--microbatches", "100000"], None, "argument --microbatches: expected at most 64"),
    (["predict", "step", "--hardware", "h800", "--model", "deepseek_v3", "--ep", "8", "--tokens-per-device", "8",
      "--context", "100", "--kv-bytes", "inf"], None, "--kv-bytes inf: Input should be a finite number"),
    (["predict", "step", "--hardware", "h800", "--model", "deepseek_v3", "--ep", "8", "--tokens-per-device", "8",
      "--context", "100", "--balancedness", "2"], None, "--balancedness 2.0: Input should be less than or equal to 1"),
    (["predict", "comm", "--hardware", "h800", "--ep", "8", "--tokens", "8", "--hidden", "64", "--topk", "9",
      "--experts", "8"], None, "--topk 9 exceeds --experts 8"),
])
def test_hostile_inputs_are_one_line_naming_the_flag_or_field(tmp_path, capsys, argv, costs, message):
    """Issue 35's Low items: deep JSON, a zero bandwidth, NaN or negative costs, unbounded --layers and
    --microbatches, predict's flags: each is one line naming the culprit, exit 2, no traceback."""
    if costs is not None:
        path = tmp_path / "costs.json"
        path.write_text(costs)
        argv = argv + ["--costs", str(path)]
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own errors
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1, err


@pytest.mark.parametrize("field", ["bf16_flops", "message_latency_s"])
def test_a_hardware_file_with_an_infinite_figure_is_refused(tmp_path, capsys, field):
    """An infinite latency used to predict negative milliseconds (issue 45): every figure must be finite."""
    from tbo.tools.predict.hardware import HARDWARE

    data = HARDWARE["h800"].model_dump()
    data[field] = float("inf")
    path = tmp_path / "hw.json"
    path.write_text(__import__("json").dumps(data))
    status = main(["predict", "step", "--hardware", str(path), "--model", "deepseek_v3", "--ep", "8",
                   "--tokens-per-device", "8", "--context", "100"])
    assert status == 2 and field in capsys.readouterr().err
