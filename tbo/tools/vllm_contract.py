"""Check tbo's vLLM contract (`tbo.integrations.vllm.contract`) against a vLLM source tree, by reading it.

Why by AST: the check must run on every admitted release in CI without installing any (a vLLM wheel is hundreds
of MB, CUDA-built, and importing it needs its torch); the sdist's Python files are enough to say whether a module,
class, method, parameter or attribute tbo depends on is still there. Nothing in the tree is imported or executed.

What it resolves, statically: a dotted module to ``vllm/a/b.py`` or ``vllm/a/b/__init__.py``; a top-level name to
its definition, following ``from x import name`` (relative too), ``import x as name`` and ``from x import *``; a
class's members through its bases where the base resolves in the tree. An attribute counts as present when the class
(or an in-tree base) assigns it in its body (a dataclass field, an annotation, an enum member), assigns
``self.<attr>`` in any method, or defines a method or property of that name.

``python -m tbo.tools.vllm_contract SOURCE [--release 0.34]`` checks one tree (a directory holding ``vllm/``, such
as an unpacked sdist, or ``site-packages``); ``fetch`` downloads a release's sdist from PyPI's simple index
(sha256 checked) and unpacks its Python files into a cache, without installing anything (``make contract``).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
import tarfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tbo.integrations.vllm.contract import CONTRACT, Entry, entries_for, release_of

__all__ = ["Failure", "SourceTree", "check", "check_entry", "fetch_release", "main", "vllm_root", "version_of"]


@dataclass(frozen=True)
class Failure:
    """An entry the tree breaks, and how."""

    entry: Entry
    problem: str

    def __str__(self) -> str:
        return f"{self.entry.label} ({self.entry.kind}; used by {self.entry.where or 'tbo'}): {self.problem}"


@dataclass
class _Module:
    name: str
    path: Path
    tree: ast.Module
    package: bool  #: an ``__init__.py``


@dataclass
class _Found:
    """A name resolved to its definition: a class, a function, or another binding (an assignment, an import of a
    module)."""

    module: _Module
    node: ast.AST | None  #: ClassDef, FunctionDef / AsyncFunctionDef, or the binding statement
    qualname: str
    extra: dict[str, object] = field(default_factory=dict)


def vllm_root(source: Path) -> Path:
    """The directory holding the ``vllm`` package in ``source``: ``source`` itself, or its one subdirectory that
    holds it (an unpacked sdist ``vllm-0.34.0/``)."""
    source = Path(source)
    if (source / "vllm" / "__init__.py").is_file():
        return source
    found = [d for d in sorted(source.iterdir()) if (d / "vllm" / "__init__.py").is_file()] if source.is_dir() else []
    if len(found) == 1:
        return found[0]
    raise FileNotFoundError(f"{source} holds no vllm package (vllm/__init__.py), directly or one level down")


def version_of(root: Path) -> str | None:
    """The vLLM version the tree says it is: an sdist's ``PKG-INFO``, an installed ``vllm-*.dist-info``, or the
    generated ``vllm/_version.py``; None when none says."""
    pkg_info = root / "PKG-INFO"
    if pkg_info.is_file():
        m = re.search(r"^Version:\s*(\S+)", pkg_info.read_text(errors="replace"), re.M)
        if m:
            return m[1]
    for info in sorted(root.glob("vllm*.dist-info")):
        m = re.match(r"vllm[-_a-z]*-(\d[^-]*)\.dist-info$", info.name)
        if m:
            return m[1]
    version_py = root / "vllm" / "_version.py"
    if version_py.is_file():
        m = re.search(r"""^(?:__version__|version)\s*(?::[^=]*)?=\s*['"]([^'"]+)['"]""", version_py.read_text(), re.M)
        if m:
            return m[1]
    return None


class SourceTree:
    """The Python modules of one vLLM tree, parsed on demand (never imported)."""

    def __init__(self, root: Path) -> None:
        self.root = vllm_root(root)
        self._modules: dict[str, _Module | None] = {}

    # ---- modules -------------------------------------------------------------------------------------------------
    def module(self, name: str) -> _Module | None:
        if name not in self._modules:
            base = self.root.joinpath(*name.split("."))
            found = None
            for path, package in ((base.with_suffix(".py"), False), (base / "__init__.py", True)):
                if path.is_file():
                    found = _Module(name, path, ast.parse(path.read_text(encoding="utf-8", errors="replace"),
                                                          str(path)), package)
                    break
            self._modules[name] = found
        return self._modules[name]

    @staticmethod
    def _absolute(module: _Module, level: int, target: str | None) -> str:
        """The absolute module of ``from <level dots><target> import ...`` inside ``module``."""
        if level == 0:
            return target or ""
        parts = module.name.split(".")
        if not module.package:
            parts = parts[:-1]
        parts = parts[:len(parts) - (level - 1)] if level > 1 else parts
        return ".".join([*parts, *([target] if target else [])])

    # ---- names ---------------------------------------------------------------------------------------------------
    def resolve(self, module_name: str, name: str, _seen: frozenset[tuple[str, str]] = frozenset()) -> _Found | None:
        """The definition ``name`` (one identifier) is bound to at the top level of module ``module_name``."""
        key = (module_name, name)
        if key in _seen:
            return None
        seen = _seen | {key}
        module = self.module(module_name)
        if module is None:
            return None
        stars: list[str] = []
        binding: _Found | None = None
        for node in self._top_level(module.tree.body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                binding = _Found(module, node, f"{module_name}.{name}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(name in _target_names(t) for t in targets):
                    binding = binding or _Found(module, node, f"{module_name}.{name}")
            elif isinstance(node, ast.ImportFrom):
                source = self._absolute(module, node.level, node.module)
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(source)
                    elif (alias.asname or alias.name) == name:
                        if self.module(source) is None:  # outside the tree (torch, ...) or compiled (vllm._C)
                            binding = _Found(module, node, f"{module_name}.{name}", {"unresolved": source})
                            continue
                        found = self.resolve(source, alias.name, seen)
                        if found is None and self.module(f"{source}.{alias.name}") is not None:
                            found = _Found(self.module(f"{source}.{alias.name}"), None, f"{source}.{alias.name}")
                        if found is not None:  # else re-exported from a module of the tree that no longer has it
                            binding = found
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name:
                        binding = _Found(module, node, alias.name)
        if binding is not None:
            return binding
        lazy = self._lazy(module, name)  # a module-level __getattr__ that answers for it (PEP 562)
        if lazy is not None:
            return lazy
        for source in stars:
            found = self.resolve(source, name, seen)
            if found is not None:
                return found
        if module.package and self.module(f"{module_name}.{name}") is not None:  # a submodule
            return _Found(self.module(f"{module_name}.{name}"), None, f"{module_name}.{name}")
        return None

    def _lazy(self, module: _Module, name: str) -> _Found | None:
        """``name`` as a module ``__getattr__`` of ``module`` serves it: the name is a string it compares with."""
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                if any(isinstance(c, ast.Constant) and c.value == name for c in ast.walk(node)):
                    return _Found(module, node, f"{module.name}.{name}", {"lazy": True})
        return None

    @staticmethod
    def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
        """A module's top-level statements, those under ``if``/``try`` (``TYPE_CHECKING`` aside) included."""
        out: list[ast.stmt] = []
        for node in body:
            if isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if "TYPE_CHECKING" not in test:
                    out += SourceTree._top_level(node.body)
                out += SourceTree._top_level(node.orelse)
            elif isinstance(node, ast.Try):
                out += SourceTree._top_level(node.body)
                for handler in node.handlers:
                    out += SourceTree._top_level(handler.body)
                out += SourceTree._top_level(node.orelse) + SourceTree._top_level(node.finalbody)
            else:
                out.append(node)
        return out

    # ---- classes -------------------------------------------------------------------------------------------------
    def bases(self, found: _Found) -> list[_Found]:
        """The in-tree classes ``found`` (a class) derives from, nearest first (a depth-first MRO, enough here)."""
        out: list[_Found] = []
        assert isinstance(found.node, ast.ClassDef)
        for base in found.node.bases:
            target = base.value if isinstance(base, ast.Subscript) else base  # Generic[T], Base[T]
            dotted = ast.unparse(target)
            head, _, rest = dotted.partition(".")
            resolved = self.resolve(found.module.name, head)
            for part in rest.split(".") if rest else []:
                if resolved is None:
                    break
                resolved = self.resolve(resolved.qualname, part) if resolved.node is None else None
            if resolved is not None and isinstance(resolved.node, ast.ClassDef):
                out.append(resolved)
                out += self.bases(resolved)
        return out

    def member(self, cls: _Found, name: str, own: bool = False) -> tuple[_Found, ast.AST] | None:
        """The definition of method or attribute ``name`` in class ``cls`` (or, unless ``own``, an in-tree base)."""
        for klass in [cls] if own else [cls, *self.bases(cls)]:
            node = klass.node
            assert isinstance(node, ast.ClassDef)
            for stmt in self._top_level(node.body):
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
                    return klass, stmt
                if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    if any(name in _target_names(t) for t in targets):
                        return klass, stmt
        return None

    def attribute(self, cls: _Found, name: str) -> bool:
        """Whether instances of ``cls`` have attribute ``name`` (the module docstring's rule)."""
        if self.member(cls, name) is not None:
            return True
        for klass in [cls, *self.bases(cls)]:
            assert isinstance(klass.node, ast.ClassDef)
            for stmt in ast.walk(klass.node):
                if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    if any(name in _self_targets(t) for t in targets):
                        return True
                elif isinstance(stmt, ast.Call) and ast.unparse(stmt.func) in ("setattr", "object.__setattr__") \
                        and len(stmt.args) >= 2 and isinstance(stmt.args[0], ast.Name) \
                        and stmt.args[0].id == "self" and isinstance(stmt.args[1], ast.Constant) \
                        and stmt.args[1].value == name:
                    return True
        return False


def _self_targets(target: ast.AST) -> set[str]:
    """The attributes ``target`` assigns on ``self``: ``self.x = ...``, ``self.x, self.y = ...`` (not
    ``self.x.y = ...`` nor ``self.x[i] = ...``, which assign into what ``self.x`` already holds)."""
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        return {target.attr}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_self_targets(t) for t in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _self_targets(target.value)
    return set()


def _target_names(target: ast.AST) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_target_names(t) for t in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return set()


def _parameters(node: ast.AST) -> list[str] | None:
    """The parameter names of a function, or of a class's constructor (its ``__init__``, or its dataclass fields);
    None when neither is known."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return None


def _positional(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    return names[1:] if names and names[0] in ("self", "cls") else names


def _constructor(tree: SourceTree, cls: _Found) -> tuple[list[str], list[str]] | None:
    """``(positional, all)`` parameter names of class ``cls``'s constructor: an ``__init__`` (its own or a base's),
    or the class's annotated fields in order (a dataclass, a NamedTuple)."""
    init = tree.member(cls, "__init__")
    if init is not None and isinstance(init[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
        node = init[1]
        return _positional(node), [p for p in _parameters(node) or [] if p != "self"]
    fields: list[str] = []
    for klass in [*reversed(tree.bases(cls)), cls]:
        assert isinstance(klass.node, ast.ClassDef)
        for stmt in klass.node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                    and "ClassVar" not in ast.unparse(stmt.annotation):
                fields.append(stmt.target.id)
    return (fields, fields) if fields else None


def check_entry(tree: SourceTree, entry: Entry) -> str | None:
    """What is wrong with ``entry`` in ``tree``; None when it holds."""
    module = tree.module(entry.module)
    if module is None:
        return f"module {entry.module} is missing"
    if entry.name is None:
        return None
    head, *rest = entry.name.split(".")
    found = tree.resolve(entry.module, head)
    if found is None:
        return f"{head} is not defined in {entry.module}"
    if ("unresolved" in found.extra or "lazy" in found.extra) and not rest and entry.kind in ("import", "patch"):
        return None  # bound here, by an import from outside the tree (or unparsed): the name exists
    target: ast.AST | None = found.node
    owner = found
    if rest:
        if not isinstance(found.node, ast.ClassDef):
            return f"{head} is not a class in {entry.module} ({found.qualname})"
        member = tree.member(found, rest[0], own=entry.own)
        if member is None:
            where = "in the class itself" if entry.own and tree.member(found, rest[0]) is not None else "on the class"
            return f"{found.node.name}.{rest[0]} is not defined {where}"
        owner, target = member
    if entry.kind == "read":
        if not isinstance(target, ast.ClassDef):
            return f"{entry.name} is not a class ({found.qualname})"
        missing = [a for a in entry.attrs if not tree.attribute(found, a)]
        if missing:
            return f"{target.name} has no attribute {', '.join(missing)}"
        return None
    if entry.kind == "subclass" and not isinstance(target, ast.ClassDef):
        return f"{entry.name} is not a class ({found.qualname})"
    if not entry.params:
        return None
    if isinstance(target, ast.ClassDef):
        signature = _constructor(tree, found)
        if signature is None:
            return f"{target.name}'s constructor parameters are not known (no __init__, no fields)"
        positional, names = signature
    elif isinstance(target, (ast.FunctionDef, ast.AsyncFunctionDef)):
        positional, names = _positional(target), [p for p in _parameters(target) or [] if p not in ("self", "cls")]
    else:
        return f"{entry.name} is bound to a {type(target).__name__} in {owner.qualname}, not a function: its " \
               f"parameters {', '.join(entry.params)} cannot be checked"
    if entry.leading:
        if tuple(positional[:len(entry.params)]) != entry.params:
            return f"{entry.name}'s leading parameters are {tuple(positional[:len(entry.params)])}, expected " \
                   f"{entry.params}"
        return None
    missing = [p for p in entry.params if p not in names]
    if missing:
        return f"{entry.name} has no parameter {', '.join(missing)} (it has {', '.join(names) or 'none'})"
    return None


def check(source: Path, release: str | None = None, entries: list[Entry] | None = None) -> tuple[str, list[Failure],
                                                                                                    int]:
    """Check the contract's entries for ``release`` (``"0.34"``; by default the tree's own version's) against the
    vLLM tree in ``source``: ``(release, failures, entries checked)``."""
    tree = SourceTree(source)
    if release is None:
        version = version_of(tree.root)
        if version is None:
            raise ValueError(f"{tree.root}: no PKG-INFO, vllm dist-info or vllm/_version.py says which vLLM this is; "
                             "pass --release")
        release = release_of(version)
    todo = entries_for(release) if entries is None else entries
    failures = []
    for entry in todo:
        problem = check_entry(tree, entry)
        if problem is not None:
            failures.append(Failure(entry, problem))
    return release, failures, len(todo)


# ---- fetching a release's sdist, without installing it ------------------------------------------------------------
SIMPLE_INDEX = "https://pypi.org/simple/vllm/"


def fetch_release(version: str, cache: Path, index: str = SIMPLE_INDEX) -> Path:
    """The Python files of vLLM ``version``'s sdist, unpacked under ``cache/<version>/`` (downloaded once from the
    simple ``index`` with its sha256 checked; a later call finds them there). Nothing is built or installed:
    ``pip download --no-binary :all:`` would build the sdist's metadata, which installs vLLM's build requirements
    (torch, cmake) first."""
    cache = Path(cache)
    target = cache / version
    done = target / ".complete"
    if done.is_file():
        return target
    request = urllib.request.Request(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    filename = f"vllm-{version}.tar.gz"
    match = [f for f in files if f["filename"] == filename]
    if not match:
        raise FileNotFoundError(f"{index} lists no sdist {filename}")
    archive = cache / filename
    expected = match[0]["hashes"]["sha256"]
    if not archive.is_file() or _sha256(archive) != expected:
        cache.mkdir(parents=True, exist_ok=True)
        partial = archive.with_suffix(".part")
        with urllib.request.urlopen(match[0]["url"], timeout=600) as response, open(partial, "wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
        if _sha256(partial) != expected:
            partial.unlink()
            raise ValueError(f"{filename}: sha256 differs from the index's {expected}")
        partial.replace(archive)
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        # the package's Python files and the version (PKG-INFO): not vLLM's tests, benchmarks, kernels
        members = [m for m in tar.getmembers() if m.isfile() and m.name.count("/") >= 1 and (
            m.name.split("/")[1] == "vllm" and m.name.endswith(".py") or m.name.split("/")[1:] == ["PKG-INFO"])]
        tar.extractall(target, members=members, filter="data")
    done.write_text(version)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tbo.tools.vllm_contract", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="check one vLLM source tree")
    c.add_argument("source", type=Path, help="a directory holding vllm/ (an unpacked sdist, site-packages)")
    c.add_argument("--release", help="the vLLM release whose entries apply (default: the tree's own version)")
    c.add_argument("-v", "--verbose", action="store_true", help="list every entry checked")
    f = sub.add_parser("fetch", help="download and unpack releases' sdists, then check each")
    f.add_argument("versions", nargs="+", help="vLLM versions, e.g. 0.32.0 0.33.0 0.34.0")
    f.add_argument("--cache", type=Path, default=Path(".cache/vllm-sdist"))
    f.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    sources = [(args.source, args.release)] if args.command == "check" else \
        [(fetch_release(v, args.cache), release_of(v)) for v in args.versions]
    failed = 0
    for source, release in sources:
        release, failures, count = check(source, release)
        bad = {id(x.entry) for x in failures}
        if args.verbose:
            for entry in entries_for(release):
                print(f"  {'FAIL' if id(entry) in bad else 'ok  '} {entry.label} ({entry.kind})")
        skipped = len(CONTRACT) - count
        print(f"vLLM {release} ({source}): {count - len(failures)}/{count} contract entries hold"
              f"{f' ({skipped} not for {release})' if skipped else ''}")
        for failure in failures:
            print(f"  FAIL {failure}")
        failed += bool(failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
