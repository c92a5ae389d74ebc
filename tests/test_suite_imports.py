"""The test suite's own layering: no test module imports another test module.

What test modules share lives in plain helper modules (`tests/split_witness.py`, `tests/listening.py`,
`tests/vllm/helpers.py`, ...) and fixtures in conftest.py files. A test module that doubles as a helper library
(as tests/test_vllm.py once did for five others) runs its own tests' module-level set-up wherever it is imported, ties
every importer to its file name and, under pytest, imports it a second time under another name. Imports are read from
the source (ast), in every file under tests/, whatever their form: ``import test_x``, ``from test_x import y``,
``from .test_x import y``, ``from . import test_x``, ``import tests.vllm.test_x``, at module level or in a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

def _package(path: Path, root: Path) -> list[str]:
    """The dotted package of a file under ``root`` (tests/ is the package ``tests``)."""
    return [root.name, *path.relative_to(root).parent.parts]

def imported_test_modules(source: str, path: Path, root: Path) -> list[str]:
    """The modules ``source`` (the file ``path`` under ``root``) imports that are test modules: a last name part
    starting with ``test_``, as pytest collects them. Returned as ``"line: module"``."""
    found = []
    package = _package(path, root)
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]  # ``from . import test_x``
        for name in names:
            if name.rsplit(".", 1)[-1].startswith("test_"):
                found.append(f"{node.lineno}: {name}")
    return found


def test_no_test_module_imports_another_test_module():
    files = sorted(TESTS.rglob("*.py"))
    assert TESTS / "vllm" / "test_engine.py" in files and TESTS / "vllm" / "helpers.py" in files  # the room is seen
    offenders = {str(f.relative_to(TESTS.parent)): found for f in files
                 if (found := imported_test_modules(f.read_text(), f, TESTS))}
    assert not offenders, f"test modules imported by other modules (move what they share to a helper): {offenders}"

def test_the_check_finds_every_form_of_import():
    path = TESTS / "vllm" / "test_x.py"
    source = "\n".join(["import test_vllm", "from test_vllm_dp import _dp", "from .test_dp import _dp",
                        "from . import test_engine, helpers", "from ..test_afd import _listening",
                        "import tests.vllm.test_spec", "def f():", "    from test_vllm import _llm",
                        "from .helpers import _llm", "from ..split_witness import SplitWitness", "import pytest"])
    assert imported_test_modules(source, path, TESTS) == [
        "1: test_vllm", "2: test_vllm_dp", "3: tests.vllm.test_dp", "4: tests.vllm.test_engine",
        "5: tests.test_afd", "6: tests.vllm.test_spec", "8: test_vllm"]
