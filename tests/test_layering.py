"""The architecture, enforced: every module's imports (parsed with `ast`, function-level ones too) must follow the
layer tables below. They are written once, here: the README's "Architecture" diagram is drawn from them
(`render_layers`), a test checks that the README's copy is the drawing, and `python tests/test_layering.py` redraws
it in place.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tbo"

#: Which layer each first-level name under `tbo` belongs to.
LAYER_OF = {
    "core": "core",
    "util": "util",
    "split": "library", "comm": "library", "experts": "library", "ops": "library", "strategies": "library",
    "models": "library",
    "integrations": "library", "afd": "library", "runtime": "library",
    "tools": "tools",
    "testing": "testing",
    "harness": "harness",
    "__init__": "api", "__main__": "api",  # the package's front door: re-exports, `python -m tbo`
}

#: Which layers a layer may import from. An arrow only points down.
ALLOWED = {
    "core": {"core"},
    "util": {"util"},
    "library": {"core", "util", "library"},
    "tools": {"core", "util", "library", "tools"},
    "testing": {"core", "util", "library", "testing"},
    "harness": {"core", "util", "library", "tools", "testing", "harness"},
    "api": {"core", "util", "library", "tools"},
}

#: What each layer is, for the drawing.
LAYER_DOC = {
    "harness": ("tbo.harness", "workloads, timing, launch, the AFD runner; examples/ and benchmarks/ use it"),
    "tools": ("tbo.tools", "lint, trace, simulate, predict, cli: read strategies, never run inside a step"),
    "testing": ("tbo.testing", "the DeepEP / DeepGEMM stand-ins, MoE test helpers"),
    "util": ("tbo.util", "optional imports, lazy attributes, interval_union; no torch"),
    "core": ("tbo.core", "ops, strategy, schedule, state, observer, errors, executors; no torch"),
}

#: The drawing's rows, top to bottom. Layers on one row import nothing from each other; an arrow only points down.
LAYER_ROWS = [("harness",), ("tools", "testing"), ("library",), ("util", "core")]

#: Inside the library, packages are ordered too: a package imports only packages on a lower row (and itself). The
#: communication layer is at the bottom; the integrations with other frameworks sit on top.
LIBRARY_ORDER = [
    (("comm",), "transports, EP backends, the FP8 wire format, SM budgets"),
    (("split", "experts"), "cutting a step into microbatches; running experts on dispatched tokens"),
    (("ops",), "the _a/_b transfer ops layers inherit"),
    (("strategies",), "op lists with Yield, and their binding to layers"),
    (("runtime",), "the forward seam, CUDA graphs, profiling"),
    (("models",), "the reference model"),
    (("afd",), "attention-FFN disaggregation: connector, wire format, FFN loop"),
    (("integrations",), "Hugging Face, vLLM and SGLang (AFD inside vLLM reuses tbo.afd)"),
]
_LIBRARY_ROW = {pkg: row for row, (pkgs, _) in enumerate(LIBRARY_ORDER) for pkg in pkgs}


def render_layers() -> str:
    """The README's architecture diagram, drawn from the tables above (top row first)."""
    entries: list[tuple[str, str, str]] = []   # (layer label, packages, what)
    for row in LAYER_ROWS:
        if entries:
            entries.append(("", "│", ""))
        for layer in row:
            if layer == "library":
                for i, (pkgs, what) in enumerate(reversed(LIBRARY_ORDER)):
                    entries.append(("library" if i == 0 else "", ", ".join(f"tbo.{p}" for p in pkgs), what))
            else:
                entries.append((layer, *LAYER_DOC[layer]))
    width = max(len(p) for _, p, _ in entries) + 3
    return "\n".join(f"{label:<10}{pkgs:<{width}}{what}".rstrip() for label, pkgs, what in entries) + "\n"


README = ROOT / "README.md"
_BEGIN, _END = "<!-- layers: drawn by tests/test_layering.py -->\n```text\n", "```\n<!-- layers end -->"

#: Third-party imports the core may use (torch and frameworks are not among them).
CORE_THIRD_PARTY = {"pydantic"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import; ``from tbo import x`` counts as ``tbo.x`` when x is a module."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (ROOT / Path(*sub.split("."))).is_dir() or (ROOT / Path(*sub.split("."))).with_suffix(
                    ".py").is_file()
                found.append((node.lineno, sub if is_module else base))
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "tbo":
        return None
    first = parts[1] if len(parts) > 1 else "__init__"
    return LAYER_OF.get(first, f"unplaced:{first}")


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_sits_in_a_layer():
    unplaced = sorted({p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in MODULES} - set(LAYER_OF))
    assert not unplaced, f"tbo/{unplaced}: add it to a layer's package (or to LAYER_OF, with a reason)"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path: Path):
    layer = _layer(_module_name(path))
    broken = []
    for line, target in _imports(path):
        target_layer = _layer(target)
        if target_layer is None:  # third party or standard library
            top = target.split(".")[0]
            if layer == "core" and top not in sys.stdlib_module_names and top not in CORE_THIRD_PARTY:
                broken.append(f"line {line}: core imports {target!r} (core uses only the standard library and "
                              f"{sorted(CORE_THIRD_PARTY)})")
            elif layer == "util" and top not in sys.stdlib_module_names:
                broken.append(f"line {line}: util imports {target!r}")
            continue
        if target_layer not in ALLOWED[layer]:
            broken.append(f"line {line}: {layer} imports {target} ({target_layer})")
        elif layer == target_layer == "library":
            here, there = _module_name(path).split(".")[1], target.split(".")[1]
            if here != there and _LIBRARY_ROW[there] >= _LIBRARY_ROW[here]:
                broken.append(f"line {line}: tbo.{here} imports {target}, but tbo.{there} is not below tbo.{here} "
                              f"in LIBRARY_ORDER")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


#: The vLLM integration is a room of sub-packages by concern, ordered too: a unit (a sub-package, or a module at the
#: room's top) imports only units on a lower row, and itself. `tbo.integrations.engine` (what every engine integration
#: shares: the step rules, the counters, the undo stack) sits below the room and imports no engine.
VLLM_ROOM = "tbo.integrations.vllm"
VLLM_ORDER = [
    (("contract",), "the vLLM symbols tbo depends on, per release: data, no vLLM (checked by tbo.tools.vllm_contract)"),
    (("errors",), "TboConfigError and refuse(): the one message shape"),
    (("afd.config",), "the AFD keys of the schema (no vLLM)"),
    (("config",), "the additional_config['tbo'] schema (no vLLM)"),
    (("stats",), "the process registry of the engines' stats"),
    (("comm",), "backends, vLLM's expert-parallel group, bounded collectives"),
    (("model",), "structure discovery, the layer adapter, experts and quantization, compute, the rotary fix"),
    (("step",), "the step pipeline: decider, graphs, adaptive, DP agreement, vLLM's decision tuple"),
    (("admit",), "every check before the weights load, and the catalog"),
    (("afd",), "attention-FFN disaggregation inside vLLM (reuses tbo.afd)"),
    (("runner",), "the engine built on a runner in undoable steps, patches, layer loop, forwards, DP, MTP draft"),
    (("plugin",), "the entry point"),
    (("metrics", "trace_route"), "the stat-logger and endpoint entry points: tbo's figures in vLLM's /metrics, "
                                 "a live trace at /tbo/trace"),
    (("__init__",), "the package's front door"),
]
_VLLM_ROW = {unit: row for row, (units, _) in enumerate(VLLM_ORDER) for unit in units}
ENGINE_COMMON = "tbo.integrations.engine"
INTEGRATION_MODULES = sorted((PACKAGE / "integrations").rglob("*.py"))
ROOM_MODULES = [p for p in INTEGRATION_MODULES if _module_name(p).startswith(VLLM_ROOM)]


def _room_unit(module: str) -> str | None:
    """The unit of the vLLM room that ``module`` belongs to (None: outside the room)."""
    if module == VLLM_ROOM:
        return "__init__"
    if not module.startswith(VLLM_ROOM + "."):
        return None
    parts = module[len(VLLM_ROOM) + 1:].split(".")
    if parts[:2] == ["afd", "config"]:
        return "afd.config"
    return parts[0]


def test_the_vllm_room_order_names_every_unit():
    units = {_room_unit(_module_name(p)) for p in ROOM_MODULES}
    assert units == set(_VLLM_ROW), f"every unit of {VLLM_ROOM} has exactly one row in VLLM_ORDER: {units ^ set(_VLLM_ROW)}"
    subpackages = {p.parent.name for p in ROOM_MODULES if p.parent.name != "vllm"}
    assert len(subpackages) >= 4, subpackages


@pytest.mark.parametrize("path", ROOM_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_vllm_room_imports_point_down(path: Path):
    here = _room_unit(_module_name(path))
    broken = [f"line {line}: {here} imports {target} ({_room_unit(target)}), not below it in VLLM_ORDER"
              for line, target in _imports(path)
              if _room_unit(target) not in (None, here) and _VLLM_ROW[_room_unit(target)] >= _VLLM_ROW[here]]
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


#: The SGLang integration is a room too, ordered the same way. What it shares with vLLM (the config schema, the
#: adaptive driver, the step rules, the counters) it takes from the kit, `tbo.integrations.engine`: nothing from the
#: vLLM room.
SGLANG_ROOM = "tbo.integrations.sglang"
SGLANG_ORDER = [
    (("errors",), "TboSglangError and refuse(): the one message shape"),
    (("config",), "TBO_SGLANG_CONFIG: the kit's schema, read at engine start (no SGLang)"),
    (("stats",), "the process registry of the engines' stats"),
    (("model",), "admission by structure, the layer as ops over SGLang's modules"),
    (("step",), "the split decision, the microbatches' ForwardBatches from SGLang's filter_batch"),
    (("runner",), "the engine built in undoable steps, the layer loop, the microbatch contexts, the metrics slot"),
    (("trace_route",), "GET /tbo/trace on SGLang's app (the engine-neutral live trace)"),
    (("metrics",), "tbo's figures in SGLang's /metrics: the collector in the registry SGLang's route builds"),
    (("plugin",), "the entry point (sglang.srt.plugins)"),
    (("__init__",), "the package's front door"),
]
_SGLANG_ROW = {unit: row for row, (units, _) in enumerate(SGLANG_ORDER) for unit in units}
SGLANG_MODULES = [p for p in INTEGRATION_MODULES if _module_name(p).startswith(SGLANG_ROOM)]


def _sglang_unit(module: str) -> str | None:
    if module == SGLANG_ROOM:
        return "__init__"
    if not module.startswith(SGLANG_ROOM + "."):
        return None
    return module[len(SGLANG_ROOM) + 1:].split(".")[0]


def test_the_sglang_room_order_names_every_unit():
    units = {_sglang_unit(_module_name(p)) for p in SGLANG_MODULES}
    assert units == set(_SGLANG_ROW), f"every unit of {SGLANG_ROOM} has one row in SGLANG_ORDER: {units ^ set(_SGLANG_ROW)}"
    assert len({p.parent.name for p in SGLANG_MODULES if p.parent.name != "sglang"}) >= 3


@pytest.mark.parametrize("path", SGLANG_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_sglang_room_imports_point_down_and_nothing_of_vllm(path: Path):
    here = _sglang_unit(_module_name(path))
    broken = [f"line {line}: {here} imports {target} ({_sglang_unit(target)}), not below it in SGLANG_ORDER"
              for line, target in _imports(path)
              if _sglang_unit(target) not in (None, here) and _SGLANG_ROW[_sglang_unit(target)] >= _SGLANG_ROW[here]]
    broken += [f"line {line}: imports {target}: what SGLang shares with vLLM comes from {ENGINE_COMMON}"
               for line, target in _imports(path)
               if target.startswith(VLLM_ROOM + ".") or target == VLLM_ROOM or target.split(".")[0] == "vllm"]
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("path", [p for p in INTEGRATION_MODULES if _module_name(p).startswith(VLLM_ROOM)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_vllm_room_imports_no_sglang(path: Path):
    wrong = [(line, t) for line, t in _imports(path) if t.split(".")[0] == "sglang" or t.startswith(SGLANG_ROOM)]
    assert not wrong, f"{path.relative_to(ROOT)} imports SGLang: {wrong}"


@pytest.mark.parametrize("path", SGLANG_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_sglang_room_has_small_modules_and_functions(path: Path):
    test_the_vllm_room_has_small_modules_and_functions(path)


@pytest.mark.parametrize("path", sorted((PACKAGE / "integrations" / "engine").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_what_every_engine_shares_imports_no_engine(path: Path):
    engines = [(line, t) for line, t in _imports(path)
               if t.split(".")[0] in ("vllm", "sglang") or t.startswith(VLLM_ROOM) or t.startswith("tbo.integrations.")
               and not t.startswith(ENGINE_COMMON)]
    assert not engines, f"{path.relative_to(ROOT)} imports an engine: {engines}"


def _import_circles(modules: list[Path]) -> list[list[str]]:
    """The import circles among ``modules`` (function-level and TYPE_CHECKING imports included): each a sorted list
    of the modules that reach one another."""
    graph = {_module_name(p): {t for _, t in _imports(p) if t.split(".")[0] == "tbo"} for p in modules}
    for module, targets in graph.items():  # `from tbo.integrations.vllm import x` names the package: its module
        graph[module] = {t for t in targets if t in graph and t != module}
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_in_tbo():
    """No module of tbo reaches itself through imports (function-level ones included): a shared piece moves down to
    a module both sides import, rather than an import hiding inside a function."""
    circles = _import_circles(MODULES)
    assert not circles, "import circles (move what both sides need into a module below them): " + "; ".join(
        " <-> ".join(c) for c in circles)


def test_the_circle_check_sees_a_function_level_circle(tmp_path, monkeypatch):
    """The circle check can fail: two modules of a package importing each other, one of them inside a function."""
    pkg = tmp_path / "tbo" / "afd"
    pkg.mkdir(parents=True)
    (pkg / "channel.py").write_text("def f():\n    from tbo.afd.group import AFDPeerError\n")
    (pkg / "group.py").write_text("from tbo.afd.channel import f\n")
    (pkg / "peer.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _import_circles(sorted(pkg.glob("*.py"))) == [["tbo.afd.channel", "tbo.afd.group"]]


@pytest.mark.parametrize("path", ROOM_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_vllm_room_has_small_modules_and_functions(path: Path):
    """No module of the room over 400 lines, no function over 80: one idea each."""
    text = path.read_text()
    assert len(text.splitlines()) <= 400, f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80]
    assert not long, f"{path.relative_to(ROOT)}: {long}"


def test_rows_agree_with_the_allowed_imports():
    """The drawing cannot claim an order the checker does not enforce: no layer imports one on its row or above."""
    assert sorted(layer for row in LAYER_ROWS for layer in row) == sorted(set(LAYER_OF.values()) - {"api"})
    for r, row in enumerate(LAYER_ROWS):
        above_or_beside = {other for upper in LAYER_ROWS[: r + 1] for other in upper}
        for layer in row:
            assert not (ALLOWED[layer] & above_or_beside) - {layer}, f"{layer} may import a layer drawn beside or above it"


def test_readme_draws_the_table():
    text = README.read_text()
    assert _BEGIN in text and _END in text, f"README.md lacks the layer drawing's markers {_BEGIN!r} ... {_END!r}"
    drawn = text.split(_BEGIN, 1)[1].split(_END, 1)[0]
    assert drawn == render_layers(), ("README.md's layer drawing is not the table's; run `python "
                                      "tests/test_layering.py` to redraw it:\n" + render_layers())


def test_library_order_names_every_library_package():
    library = {name for name, layer in LAYER_OF.items() if layer == "library"}
    assert set(_LIBRARY_ROW) == library, "every library package has exactly one row in LIBRARY_ORDER"


def test_the_checker_sees_violations(tmp_path, monkeypatch):
    """The checker itself can fail: a core module importing torch, a library module importing the harness, and a
    library package importing one above it."""
    fake = tmp_path / "tbo"
    (fake / "core").mkdir(parents=True)
    (fake / "comm").mkdir()
    (fake / "harness").mkdir()
    (fake / "core" / "bad.py").write_text("import torch\nfrom ..comm import x\n")
    (fake / "comm" / "bad.py").write_text("def f():\n    from tbo.harness import workload\n")
    (fake / "harness" / "workload.py").write_text("")
    (fake / "comm" / "up.py").write_text("from tbo.strategies import deepseek\n")
    (fake / "strategies").mkdir()
    (fake / "strategies" / "deepseek.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [t for _, t in _imports(fake / "core" / "bad.py")] == ["torch", "tbo.comm"]
    with pytest.raises(AssertionError, match="core imports 'torch'"):
        test_imports_point_down(fake / "core" / "bad.py")
    with pytest.raises(AssertionError, match=r"library imports tbo.harness.workload \(harness\)"):
        test_imports_point_down(fake / "comm" / "bad.py")
    with pytest.raises(AssertionError, match=r"tbo.comm imports tbo.strategies.deepseek, but tbo.strategies is not below"):
        test_imports_point_down(fake / "comm" / "up.py")


def test_the_checker_sees_sglang_take_from_vllm(tmp_path, monkeypatch):
    """The SGLang room's check can fail: a module of it importing the vLLM room's config is named."""
    room = tmp_path / "tbo" / "integrations" / "sglang"
    room.mkdir(parents=True)
    (room / "config.py").write_text("from tbo.integrations.vllm.config import TboVllmConfig\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"imports tbo.integrations.vllm.config: what SGLang shares with vLLM"):
        test_the_sglang_room_imports_point_down_and_nothing_of_vllm(room / "config.py")


_BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, _NoTorch())
"""


def test_import_tbo_needs_no_torch():
    code = _BLOCK_TORCH + (
        "import tbo, tbo.core, tbo.split\n"
        "s = tbo.OperationsStrategy(operations=['a', tbo.Yield, 'b'], delta_stages=1)\n"
        "assert tbo.lint(s) == [] and tbo.SplitPolicy().plan(tbo.ForwardMode.DECODE, 64) is not None\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "try:\n    tbo.split_inputs\nexcept ImportError as e:\n    print('lazy', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "lazy torch is blocked" in out.stdout  # the torch-needing name fails where it is used, not at import


def test_subpackages_are_attributes_of_tbo():
    """`import tbo; tbo.strategies.register(...)`, as the docs write it: a subpackage is imported on first use (so
    `import tbo` still imports no torch), every subpackage of tbo is reachable that way, and a typo is still an
    AttributeError."""
    import pkgutil

    import tbo as pkg

    subpackages = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.ispkg)
    code = (
        "import sys, tbo\n"
        "assert 'tbo.strategies' not in sys.modules\n"
        "tbo.strategies.register('issue27', tbo.strategies.get('deepseek_decode'))\n"
        "assert tbo.strategies.get('issue27').name == 'issue27'\n"
        f"for name in {subpackages!r}:\n"
        "    assert getattr(tbo, name) is sys.modules['tbo.' + name], name\n"
        "try:\n    tbo.strategiess\nexcept AttributeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "module 'tbo' has no attribute 'strategiess'" in out.stdout


def test_core_imports_no_torch_even_with_torch_installed():
    code = "import sys, tbo.core, tbo.tools.lint; assert 'torch' not in sys.modules, sorted(sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr


if __name__ == "__main__":   # redraw the README's diagram from the tables
    head, rest = README.read_text().split(_BEGIN, 1)
    README.write_text(head + _BEGIN + render_layers() + _END + rest.split(_END, 1)[1])
    print(render_layers(), end="")


#: the words `tbo.split.kinds` holds as `StepKind` and `Slot` members ("idle" is also an unsplit reason's name)
STEP_WORDS = {"decode", "prefill", "mixed", "warmup", "draft"}
#: where a step's kind or slot is read or written: the engine integrations and the splitting package
VOCABULARY_MODULES = sorted(p for p in [*(PACKAGE / "integrations").rglob("*.py"), *(PACKAGE / "split").rglob("*.py")]
                            if p.name != "kinds.py")


def _step_words(text: str) -> list[str]:
    """The string constants of ``text`` that spell a step kind or slot, docstrings left out: ``line: 'word'``."""
    tree = ast.parse(text)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [f"{n.lineno}: {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in STEP_WORDS
            and id(n) not in docstrings]


@pytest.mark.parametrize("path", VOCABULARY_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_step_kinds_and_slots_are_enum_members_not_strings(path: Path):
    """One vocabulary (issue 58): code that names a step's kind or strategy slot uses `tbo.split.kinds`' members
    (``StepKind.DECODE``, ``Slot.PREFILL``), never the bare string (``ForwardMode``'s own values aside)."""
    found = [w for w in _step_words(path.read_text())
             if not (path.name == "index.py" and w.endswith("'decode'"))]  # ForwardMode.DECODE's value
    assert not found, f"{path.relative_to(ROOT)}: {found}"


def test_the_vocabulary_check_sees_a_bare_word():
    """The check can fail: a comparison with a bare "prefill" is found, its docstring is not."""
    assert _step_words('def f(step):\n    """A "decode" step."""\n    return step.kind == "prefill"\n') == \
        ["3: 'prefill'"]
