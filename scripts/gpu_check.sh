#!/usr/bin/env bash
# The GPU check: tbo's GPU tests and benchmarks/gpu.py, on a machine with a GPU and a CUDA torch but no package index.
#
#   scripts/gpu_check.sh WHEELS_DIR            # e.g. scripts/gpu_check.sh /tmp/wheels
#   PYTHON=/opt/venv/bin/python scripts/gpu_check.sh /tmp/wheels
#
# WHEELS_DIR holds the wheels of tbo's other dependencies (pydantic and what it needs, pytest, hypothesis,
# setuptools); nothing is fetched from an index. Make it where an index is reachable, for the GPU machine's
# Python version and platform, e.g. for Python 3.12 on x86-64 Linux:
#   pip download -d wheels --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       "pydantic>=2" "pytest>=7" "hypothesis>=6" "setuptools>=64"
# torch is never installed or upgraded: tbo goes in with --no-deps over the CUDA torch already there.
# Budget: GPU tests up to 180 s, the benchmark (--quick) up to 150 s; with the installs, under 6 minutes.
set -euo pipefail

WHEELS="${1:?usage: scripts/gpu_check.sh WHEELS_DIR (a folder of wheels: pydantic, pytest, hypothesis, setuptools)}"
PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[ -d "$WHEELS" ] || { echo "gpu_check: $WHEELS is not a folder of wheels" >&2; exit 2; }
START=$(date +%s)

echo "== torch and the device"
"$PY" - <<'PYEOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device (a CPU build, or no driver); "
             "install your CUDA torch first")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PYEOF

echo "== dependencies from $WHEELS (no index)"
"$PY" -m pip install -q --no-index --find-links "$WHEELS" "pydantic>=2" "pytest>=7" "hypothesis>=6" "setuptools>=64"

echo "== tbo, --no-deps over this torch"
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e "$ROOT"
"$PY" -c "import torch, tbo; assert torch.cuda.is_available(); print('tbo', tbo.__version__, 'over torch', torch.__version__)"

echo "== GPU tests (pytest -m gpu)"
status=0
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests || status=$?

echo "== benchmarks/gpu.py --quick"
timeout 150 "$PY" benchmarks/gpu.py --quick || status=$?

echo "== done in $(( $(date +%s) - START )) s, exit status $status"
exit $status
