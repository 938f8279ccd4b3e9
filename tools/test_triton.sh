#!/usr/bin/env bash
# The CPU test suite on another Triton release (CI: the newest supported one), in a virtual environment of its
# own (.venv-triton-VERSION, over the system's packages) set up as tools/test.sh sets up its own, then that
# Triton installed over it (torch unchanged):
#     bash tools/test_triton.sh 3.9.0 [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VER=${1:?usage: tools/test_triton.sh TRITON_VERSION [pytest args]}
shift
VENV=.venv-triton-$VER
[ -x "$VENV/bin/python" ] || ${PYTHON:-python3} -m venv --system-site-packages "$VENV"
export PYTHON="$PWD/$VENV/bin/python"
bash tools/setup.sh  # the test extras (torch kept)
"$PYTHON" -c "import triton, sys; sys.exit(0 if triton.__version__ == '$VER' else 1)" 2>/dev/null ||
  "$PYTHON" -m pip install -q "triton==$VER"
echo "[test_triton] $("$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
exec "$PYTHON" -m pytest -q -ra --durations=10 -n auto --dist loadgroup tests "$@"
