"""After `mkdocs build`: every public name of the documented modules has an entry in the built API reference.

mkdocstrings renders what it can resolve statically and stays quiet about the rest (a lazily imported name, a
module left off a page), so `--strict` alone cannot tell that the reference is complete. This reads each module's
`__all__` and looks for the name's anchor in the built pages under SITE/api.

    python scripts/check_api_docs.py site
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

#: The modules the API reference documents (the issue's public packages, and the submodules that hold their names).
MODULES = [
    "tbo", "tbo.split", "tbo.split.kinds", "tbo.split.tensors", "tbo.split.agree", "tbo.comm", "tbo.comm.emulated",
    "tbo.comm.sm_budget",
    "tbo.strategies", "tbo.runtime.forward", "tbo.runtime.cuda_graph", "tbo.runtime.profile", "tbo.runtime.op_times",
    "tbo.tools.lint", "tbo.tools.trace", "tbo.tools.simulate", "tbo.tools.predict", "tbo.integrations.transformers",
    "tbo.integrations.vllm",
]


def anchors(site: Path) -> set[str]:
    found: set[str] = set()
    for page in (site / "api").rglob("*.html"):
        found |= set(re.findall(r'id="(tbo[\w.]*)"', page.read_text()))
    return found


def missing(site: Path) -> list[str]:
    ids = anchors(site)
    gaps = []
    for name in MODULES:
        module = importlib.import_module(name)
        for public in getattr(module, "__all__", ()):
            if f"{name}.{public}" not in ids and not any(i.endswith(f".{public}") for i in ids):
                gaps.append(f"{name}.{public}")
    return gaps


if __name__ == "__main__":
    site = Path(sys.argv[1] if len(sys.argv) > 1 else "site")
    if not (site / "api").is_dir():
        sys.exit(f"{site}/api does not exist: run mkdocs build first")
    gaps = missing(site)
    if gaps:
        sys.exit("the API reference lacks these public names (add their module to a page in docs/api/):\n  "
                 + "\n  ".join(gaps))
    print(f"API reference: every public name of {len(MODULES)} modules has an entry")
