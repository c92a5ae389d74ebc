"""benchmarks/gpu.py and the demo's device choice on a CPU: the benchmark says it needs a GPU and exits 0, its
pipeline runs end to end with --smoke (a tiny model, graphs re-run by EagerCapturer), and the demo refuses
``--device cuda`` without CUDA with a clear message; scripts/gpu_check.sh at least parses and checks its argument."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem + "_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_benchmark_without_a_gpu_says_so_and_exits_0(capsys):
    bench = load(ROOT / "benchmarks" / "gpu.py")
    assert bench.main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_benchmark_smoke_runs_the_whole_pipeline(capsys):
    bench = load(ROOT / "benchmarks" / "gpu.py")
    assert bench.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| decode") or line.startswith("| prefill")]
    assert len(table) == 4  # two decode sizes, two prefill shapes
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[-1]) < 1e-4  # TBO and graphs agree with eager single (fp32, fast mode)
        assert " / " in cells[-3] and " / " in cells[-2]  # predicted / measured, both columns
    assert "measure nothing" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_demo_cuda_without_a_gpu_is_a_clear_error():
    demo = load(ROOT / "examples" / "demo.py")
    with pytest.raises(SystemExit, match="sees no CUDA device; use --device cpu"):
        demo.main(["--device", "cuda"])


def test_gpu_check_script_needs_its_wheel_folder(tmp_path):
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    missing = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert missing.returncode != 0 and "WHEELS_DIR" in missing.stderr
    nowhere = subprocess.run(["bash", str(script), str(tmp_path / "nope")], capture_output=True, text=True)
    assert nowhere.returncode == 2 and "not a folder of wheels" in nowhere.stderr
    if not torch.cuda.is_available():  # the device check comes before anything is installed
        empty = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True,
                               env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
        assert empty.returncode != 0 and "sees no CUDA device" in empty.stderr
