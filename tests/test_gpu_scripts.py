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
    assert "correctness: 4 of 4 rows within tolerance" in out
    # no GPU to park: the GPU-timeline columns say they are not front-loaded instead of passing for it
    assert all(line.split("|")[9].strip().endswith("*") for line in table)
    assert out.count("NOT front-loaded: no GPU to park") == 4


def _corrupt(monkeypatch, bench, how):
    """The smoke pipeline with one mode's logits made wrong (``how``), at one decode size."""
    from tbo.harness.gpu import GpuWorkload

    monkeypatch.setattr(bench, "SMOKE_DECODE", [8], raising=False)
    monkeypatch.setattr(bench, "SMOKE_PREFILL", [], raising=False)
    real = GpuWorkload.step

    def step(self, mode, n, tbo, graph, length=1):
        fn = real(self, mode, n, tbo, graph, length)
        return (lambda: how(fn())) if (tbo and graph) else fn

    monkeypatch.setattr(GpuWorkload, "step", step)


@pytest.mark.parametrize("how,why", [(lambda out: out + 0.05 * out.abs().max(), "graph_tbo differs from eager_single"),
                                     (lambda out: out * float("nan"), "graph_tbo or eager_single is not finite")])
def test_benchmark_exits_1_when_a_result_exceeds_the_tolerance(monkeypatch, capsys, how, why):
    """Issue 22, defect 10: max_diff was printed and never checked, so gpu_check.sh passed with wrong graphs."""
    bench = load(ROOT / "benchmarks" / "gpu.py")
    _corrupt(monkeypatch, bench, how)
    assert bench.main(["--smoke"]) == 1
    out = capsys.readouterr().out
    assert why in out and "correctness: 0 of 1 rows within tolerance" in out and "FAILED" in out


def test_link_timing_events_only_inside_trace(monkeypatch):
    """Issue 22, defect 8: each transfer recorded four timing events during timed steps too, and TBO has twice the
    transfers: a bias between eager single and TBO. Now the link times transfers only while `trace` runs."""
    from tbo.harness.gpu import GpuShape, GpuWorkload
    from tbo.tools.trace import Tracer

    work = GpuWorkload(GpuShape.tiny(num_layers=2), "cpu", [4], capture=False)
    assert work.link.timing is False
    work.time({"tbo": work.step("decode", 4, True, False)}, repeats=1, warmup=0)
    assert work.link.timing is False
    seen = []

    class Watching(Tracer):
        def on_op_start(self, mb, stage, name):
            seen.append(work.link.timing)
            super().on_op_start(mb, stage, name)

    work.tracer = Watching()
    trace = work.trace("decode", 4, True)
    assert seen and all(seen) and work.link.timing is False and trace.lane("comm")
    boom = RuntimeError("boom")

    def failing(*args, **kwargs):
        raise boom

    monkeypatch.setattr(work.model, "forward_tbo", failing)
    with pytest.raises(RuntimeError, match="boom"):
        work.trace("decode", 4, True)
    assert work.link.timing is False  # restored on the way out


def test_front_load_verdict():
    """Issue 22, defect 7: whether a front-loaded trace is the GPU's own timeline is checked, not assumed."""
    from tbo.harness.gpu import FrontLoad
    from tbo.tools.trace import Trace

    assert FrontLoad(woke_s=0.2, queued_s=0.15).ok and "queued 50.0 ms before" in str(FrontLoad(0.2, 0.15))
    late = FrontLoad(woke_s=0.2, queued_s=0.23)
    assert not late.ok and "NOT front-loaded" in str(late) and "30.0 ms after" in str(late)
    assert FrontLoad.of(Trace()) is None
    assert FrontLoad.of(Trace(marks={"gpu_woke": 0.2, "queued": 0.1})) == FrontLoad(0.2, 0.1)


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


def _wheel(folder, name, version, requires=(), tag="py3-none-any"):
    """A minimal real wheel file: the dist-info METADATA is all the prerequisite check reads."""
    import zipfile

    path = folder / f"{name}-{version}-{tag}.whl"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta + "\n")
    return path


def test_prerequisites_follow_each_wheels_metadata_for_the_target_python(tmp_path):
    """gpu_prereqs.py walks the requirements through every wheel's own Requires-Dist, with the target's markers and
    tags: what `pip download` for another Python gets wrong (it evaluates markers for the Python it runs on)."""
    prereqs = load(ROOT / "scripts" / "gpu_prereqs.py")
    _wheel(tmp_path, "pydantic", "2.99.0", ["pydantic-core==2.50.0", "typing-extensions>=4.6",
                                            'exceptiongroup>=1; python_version < "3.11"',
                                            'email-validator; extra == "email"'])
    _wheel(tmp_path, "pydantic_core", "2.50.0", tag="cp311-cp311-manylinux_2_17_x86_64")  # binary, for 3.11 only
    _wheel(tmp_path, "typing_extensions", "4.12.0")
    _wheel(tmp_path, "pytest", "8.0.0", ["iniconfig", "pluggy<2,>=1.5", 'tomli>=1; python_version < "3.11"'])
    _wheel(tmp_path, "pluggy", "1.4.0")  # too old for that pytest
    _wheel(tmp_path, "setuptools", "69.5.1")  # too old for the no-build-isolation editable install

    def names(version):
        linux = ["manylinux_2_17_x86_64", "manylinux2014_x86_64"]
        return {str(req.name): why for req, why in prereqs.missing(tmp_path, version, linux, wheels_only=True)}

    at312, at310 = names("3.12"), names("3.10")
    assert set(at312) == {"pydantic-core", "iniconfig", "pluggy", "hypothesis", "setuptools"}
    assert "needed by pydantic" in at312["pydantic-core"] and "needed by pytest" in at312["pluggy"]
    assert set(at310) == set(at312) | {"exceptiongroup", "tomli"}
    assert "pydantic-core" not in names("3.11")  # the binary wheel fits 3.11
    listed = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_prereqs.py"), str(tmp_path), "--wheels-only",
                             "--python-version", "3.10", "--platform", "manylinux2014_x86_64", "--list-missing"],
                            capture_output=True, text=True)
    assert listed.returncode == 2 and "setuptools>=70.1" in listed.stdout.split() and "tomli>=1" in listed.stdout


def test_gpu_check_names_every_missing_prerequisite_and_installs_nothing(tmp_path):
    """A fresh venv (pip and an old setuptools, no torch) and an empty wheel folder: every prerequisite missing is
    named, the exit status is 2, and nothing has been installed."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    before = subprocess.run([str(py), "-m", "pip", "freeze", "--all"], capture_output=True, text=True).stdout
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(wheels)], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "PYTHON": str(py)}, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    for what in ("pydantic>=2", "pytest>=7", "hypothesis>=6", "setuptools>=70.1", "torch does not import"):
        assert f"missing: {what}" in run.stderr or f"missing: CUDA: {what}" in run.stderr, (what, run.stderr)
    assert "prerequisite(s) missing" in run.stderr and "gpu_wheels.sh" in run.stderr
    after = subprocess.run([str(py), "-m", "pip", "freeze", "--all"], capture_output=True, text=True).stdout
    assert after == before
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_wheels.sh")]).returncode == 0
