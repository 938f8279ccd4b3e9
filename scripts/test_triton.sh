#!/usr/bin/env bash
# The CPU test suite on another Triton release (CI: the newest supported one), in a venv layered over the
# environment scripts/test.sh set up (same torch, same extras; only Triton differs):
#     bash scripts/test_triton.sh 3.9.0 [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VER=${1:?usage: scripts/test_triton.sh TRITON_VERSION [pytest args]}
shift
PY=${PYTHON:-python3}
VENV=${VENV_DIR:-.venv-triton-$VER}
if [ ! -x "$VENV/bin/python" ]; then
  $PY -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/python" -c "import triton, sys; sys.exit(0 if triton.__version__ == '$VER' else 1)" 2>/dev/null ||
  "$VENV/bin/python" -m pip install -q "triton==$VER"
echo "[test_triton] $("$VENV/bin/python" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
exec "$VENV/bin/python" -m pytest -q -ra --durations=10 -n auto --dist loadgroup tests "$@"
