"""What scripts/gpu_check.sh needs before it installs anything, and what is missing: run by it, and by gpu_wheels.sh.

    python scripts/gpu_prereqs.py WHEELS                          # for this interpreter (what gpu_check.sh runs)
    python scripts/gpu_prereqs.py WHEELS --python-version 3.12 --platform manylinux_2_17_x86_64 --wheels-only

Walks the requirements of the GPU check (tbo's pydantic, the test tools, a setuptools new enough for a
no-build-isolation editable install) down to every transitive dependency, reading each wheel's own metadata, with
the environment markers of the target Python. A requirement is met by a distribution already installed in this
interpreter (unless ``--wheels-only``) or by a wheel in WHEELS whose tags the target accepts (pydantic-core is
binary: a cp312 manylinux x86_64 wheel for Python 3.12 on x86-64 Linux). For this interpreter it also checks that
torch imports and sees a CUDA device (``--no-cuda`` skips that). Prints one line per missing thing, exits 2 if any.

Only the standard library and pip's own vendored ``packaging`` are used: the GPU machine has no index to install
anything else from.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
import zipfile
from pathlib import Path

from pip._vendor.packaging import tags
from pip._vendor.packaging.markers import default_environment
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

#: What the GPU check installs: tbo's non-torch dependency, its test tools, and the build backend of the editable
#: install (70.1 is the first setuptools that builds wheels without the separate `wheel` package).
REQUIREMENTS = ["pydantic>=2", "pytest>=7", "hypothesis>=6", "setuptools>=70.1"]


def target_tags(python_version: str | None, platforms: list[str]) -> set[tags.Tag]:
    if python_version is None:
        return set(tags.sys_tags())
    version = tuple(int(p) for p in python_version.split(".")[:2])
    abi = f"cp{version[0]}{version[1]}"
    found = set(tags.cpython_tags(version, abis=[abi, "abi3", "none"], platforms=platforms))
    found |= set(tags.compatible_tags(version, interpreter=abi, platforms=platforms))
    return found


def target_environment(python_version: str | None, platforms: list[str]) -> dict[str, str]:
    env = default_environment()
    if python_version is not None:
        env.update(python_version=".".join(python_version.split(".")[:2]), python_full_version=python_version
                   if python_version.count(".") == 2 else python_version + ".0", implementation_name="cpython",
                   platform_python_implementation="CPython")
        if platforms and all("linux" in p for p in platforms):
            env.update(sys_platform="linux", platform_system="Linux", os_name="posix")
        if platforms and all(p.endswith("x86_64") for p in platforms):
            env.update(platform_machine="x86_64")
    return env


def wheels_in(folder: Path, accepted: set[tags.Tag]) -> dict[str, list[tuple[object, Path]]]:
    """Per canonical name, the (version, path) of every wheel in ``folder`` the target accepts."""
    found: dict[str, list[tuple[object, Path]]] = {}
    for path in sorted(folder.glob("*.whl")):
        try:
            name, version, _, wheel_tags = parse_wheel_filename(path.name)
        except Exception:  # noqa: BLE001 - a file that is not a wheel is not a candidate
            continue
        if wheel_tags & accepted:
            found.setdefault(canonicalize_name(name), []).append((version, path))
    return found


def wheel_requires(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        text = z.read(meta).decode("utf-8", "replace")
    head = text.split("\n\n", 1)[0]
    return [line.split(":", 1)[1].strip() for line in head.splitlines() if line.startswith("Requires-Dist:")]


def installed(name: str) -> tuple[str, list[str]] | None:
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return None
    return dist.version, list(dist.requires or [])


def missing(folder: Path, python_version: str | None, platforms: list[str],
            wheels_only: bool) -> list[tuple[Requirement, str]]:
    """Every requirement, transitive ones included, that neither this environment nor the folder meets: each with
    what it says about it."""
    accepted = target_tags(python_version, platforms)
    env = target_environment(python_version, platforms)
    wheels = wheels_in(folder, accepted)
    gaps: list[tuple[Requirement, str]] = []
    seen: set[str] = set()
    todo = [(Requirement(r), "the GPU check") for r in REQUIREMENTS]
    while todo:
        req, by = todo.pop(0)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        have = None if wheels_only else installed(req.name)
        if have is not None and req.specifier.contains(have[0], prereleases=True):
            todo += [(Requirement(r), req.name) for r in have[1]]
            continue
        fits = sorted((v, p) for v, p in wheels.get(name, []) if req.specifier.contains(str(v), prereleases=True))
        if fits:
            todo += [(Requirement(r), req.name) for r in wheel_requires(fits[-1][1])]
            continue
        where = f"installed {have[0]}, " if have is not None else ""
        gaps.append((req, f"{req} (needed by {by}): {where}no wheel for this Python in {folder}"))
    return gaps


def cuda_problem() -> str | None:
    try:
        import torch
    except ImportError as exc:
        return f"torch does not import ({exc}): install your CUDA torch first"
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} sees no CUDA device (a CPU build, or no driver): install your CUDA torch "
                "first")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", type=Path)
    parser.add_argument("--python-version", help="check for this Python (e.g. 3.12), not this interpreter")
    parser.add_argument("--platform", action="append", default=[], help="platform tags of the target (repeatable)")
    parser.add_argument("--wheels-only", action="store_true", help="ignore what this interpreter has installed")
    parser.add_argument("--no-cuda", action="store_true", help="do not check for torch and a CUDA device")
    parser.add_argument("--list-missing", action="store_true",
                        help="print only the missing requirements, one a line (what gpu_wheels.sh downloads next)")
    args = parser.parse_args(argv)
    if not args.wheels.is_dir():
        print(f"gpu_check: {args.wheels} is not a folder of wheels", file=sys.stderr)
        return 2
    gaps = missing(args.wheels, args.python_version, args.platform, args.wheels_only)
    if args.list_missing:
        for req, _ in gaps:
            print(f"{req.name}{req.specifier}")
        return 2 if gaps else 0
    problems = [f"missing: {why}" for _, why in gaps]
    if not args.no_cuda and args.python_version is None:
        problem = cuda_problem()
        if problem:
            problems.append(f"missing: CUDA: {problem}")
    for line in problems:
        print(f"gpu_check: {line}", file=sys.stderr)
    if problems:
        print(f"gpu_check: {len(problems)} prerequisite(s) missing; build the wheel folder with scripts/gpu_wheels.sh "
              "where an index is reachable", file=sys.stderr)
        return 2
    print(f"prerequisites: every requirement met from {'' if args.wheels_only else 'this environment and '}"
          f"{args.wheels}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
