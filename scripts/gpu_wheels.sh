#!/usr/bin/env bash
# Build the wheel folder scripts/gpu_check.sh installs from, on a machine that reaches a package index.
#
#   scripts/gpu_wheels.sh                      # wheels/ for CPython 3.12 on x86-64 Linux (manylinux)
#   scripts/gpu_wheels.sh DIR 3.10             # another folder, another Python
#   PYTHON=/usr/bin/python3.12 scripts/gpu_wheels.sh
#
# `pip download` resolves the GPU check's requirements (scripts/gpu_prereqs.py: REQUIREMENTS) for the target
# Python and platform, transitive dependencies included (pydantic-core, binary: the cpXY manylinux x86_64 wheel;
# annotated-types, typing-extensions, typing-inspection, iniconfig, packaging, pluggy, attrs, sortedcontainers,
# and on 3.10 exceptiongroup and tomli), binary wheels only. Then gpu_prereqs.py checks the folder alone for that
# target and names anything still missing. wheels/ is git-ignored: carry it to the GPU machine with the repository.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/wheels}"
VERSION="${2:-3.12}"
PY="${PYTHON:-python3}"
PLATFORMS=(manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64)
ABI="cp${VERSION/./}"
mkdir -p "$DIR"

requirements=$("$PY" - "$ROOT/scripts" <<'PYEOF'
import sys
sys.path.insert(0, sys.argv[1])
from gpu_prereqs import REQUIREMENTS
print(" ".join(REQUIREMENTS))
PYEOF
)
platform_flags=()
for p in "${PLATFORMS[@]}"; do platform_flags+=(--platform "$p"); done

# pip evaluates environment markers for the Python it runs on, not the target (a 3.11 pip skips 3.10's
# `python_version < "3.11"` dependencies): gpu_prereqs.py reads the wheels' metadata for the target instead and
# names what is still missing, which the next round downloads
for round in 1 2 3 4 5; do
    echo "== pip download, round $round, for CPython $VERSION ($ABI), ${PLATFORMS[*]}: $requirements"
    # shellcheck disable=SC2086  # the requirements are words
    "$PY" -m pip download -q -d "$DIR" --only-binary=:all: --python-version "$VERSION" --implementation cp \
        --abi "$ABI" "${platform_flags[@]}" $requirements
    requirements=$("$PY" "$ROOT/scripts/gpu_prereqs.py" "$DIR" --python-version "$VERSION" "${platform_flags[@]}" \
        --wheels-only --list-missing | tr '\n' ' ') && break
    [ -n "${requirements// /}" ] || break
done

echo "== check: $DIR alone, for CPython $VERSION"
"$PY" "$ROOT/scripts/gpu_prereqs.py" "$DIR" --python-version "$VERSION" "${platform_flags[@]}" --wheels-only
ls "$DIR"
