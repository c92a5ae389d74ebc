#!/usr/bin/env bash
# The GPU check: tbo's GPU tests and benchmarks/gpu.py, on a machine with a GPU and a CUDA torch but no package index.
#
#   scripts/gpu_check.sh WHEELS_DIR            # e.g. scripts/gpu_check.sh wheels
#   PYTHON=/opt/venv/bin/python scripts/gpu_check.sh wheels
#
# WHEELS_DIR holds the wheels of everything the check installs besides torch: pydantic and its dependencies
# (pydantic-core is binary), pytest, hypothesis and theirs, setuptools >= 70.1 (the editable install runs without
# build isolation). Build it where an index is reachable, for the GPU machine's Python: scripts/gpu_wheels.sh
# (default CPython 3.12, manylinux x86_64). torch is never installed or upgraded: tbo goes in with --no-deps over the
# CUDA torch already there.
#
# First every prerequisite is checked and each missing one named (scripts/gpu_prereqs.py: the wheels, transitive
# ones included, or what this Python already has; setuptools; torch seeing a CUDA device), exit 2 before anything is
# installed. Each step then has a time cap, and all of them a deadline (GPU_CHECK_BUDGET_S, default 345 s), so the
# whole check ends in under 6 minutes. Exit status: 0 only if the GPU tests passed and the benchmark's correctness
# checks held (its speed targets are reported, not required); otherwise the first failing step's status.
set -uo pipefail

WHEELS="${1:-}"
if [ -z "$WHEELS" ]; then
    echo "usage: scripts/gpu_check.sh WHEELS_DIR (a folder of wheels: build it with scripts/gpu_wheels.sh)" >&2
    exit 2
fi
PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUDGET="${GPU_CHECK_BUDGET_S:-345}"
START=$(date +%s)
cd "$ROOT"
[ -d "$WHEELS" ] || { echo "gpu_check: $WHEELS is not a folder of wheels" >&2; exit 2; }
if ! command -v "$PY" >/dev/null; then
    echo "gpu_check: missing: $PY (set PYTHON to the interpreter with your CUDA torch)" >&2
    exit 2
fi

# capped STEP_CAP_S COMMAND...: run with the step's cap, or less when the deadline is nearer
capped() {
    local cap=$1 left
    shift
    left=$(( BUDGET - ($(date +%s) - START) ))
    (( left < cap )) && cap=$left
    if (( cap < 5 )); then
        echo "gpu_check: out of time (${BUDGET} s) before: $*" >&2
        return 124
    fi
    timeout --kill-after=5 "$cap" "$@"
}

status=0
step() {  # step NAME CAP COMMAND...: run it, remember the first failure
    local name=$1 cap=$2 rc
    shift 2
    echo "== $name (cap ${cap} s)"
    capped "$cap" "$@"
    rc=$?
    (( rc == 124 || rc == 137 )) && echo "gpu_check: $name ran out of time" >&2
    (( rc != 0 )) && echo "gpu_check: $name failed (exit $rc)" >&2
    (( rc != 0 && status == 0 )) && status=$rc
    return $rc
}

step "prerequisites" 30 "$PY" "$ROOT/scripts/gpu_prereqs.py" "$WHEELS" || exit 2
step "dependencies from $WHEELS (no index)" 45 "$PY" -m pip install -q --no-index --find-links "$WHEELS" \
    "pydantic>=2" "pytest>=7" "hypothesis>=6" "setuptools>=70.1" || exit $status
step "tbo, --no-deps over this torch" 30 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation \
    -e "$ROOT" || exit $status
step "import" 20 "$PY" -c "import torch, tbo; assert torch.cuda.is_available(); print('tbo', tbo.__version__, \
'over torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())" || exit $status
step "GPU tests (pytest -m gpu)" 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests
tests=$?
step "benchmarks/gpu.py --quick (correctness checked, targets reported)" 110 "$PY" benchmarks/gpu.py --quick
bench=$?

echo "== done in $(( $(date +%s) - START )) s: GPU tests exit $tests, benchmark exit $bench; exit status $status"
exit $status
