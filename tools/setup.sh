#!/usr/bin/env bash
# Installs vc_compile with the extras a job needs (default: test,demo), through pyproject.toml's own
# requirements (so CI exercises them), without replacing a suitable torch:
#     bash tools/setup.sh                 # pip install -e ".[test,demo]"
#     VC_EXTRAS=bench bash tools/setup.sh # another set of extras ("" = the core only)
# A machine without torch >= 2.11 first gets torch==2.13.0 (on this project's CPU machines pip's
# configuration resolves it to the local CPU build; a plain `torch` would pull a multi-GB CUDA build),
# and the installed torch is pinned while the extras resolve, so no extra can swap it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if v >= (2, 11) else 1)' 2>/dev/null; then
  echo "[setup] installing torch==2.13.0"
  $PY -m pip install -q torch==2.13.0
fi
# triton: the version torch was built against when torch pins one (CUDA builds do); else 3.6.0, the one
# the CPU interpreter tests were written against (pyproject: triton >= 3.6)
$PY -c 'import triton' 2>/dev/null || $PY -m pip install -q triton==3.6.0
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
$PY -c 'import torch, triton; print(f"torch=={torch.__version__}"); print(f"triton=={triton.__version__}")' > "$pin"
EXTRAS=${VC_EXTRAS-test,demo}
$PY -m pip install -q -c "$pin" -e ".${EXTRAS:+[$EXTRAS]}"
echo "[setup] ok: vc_compile[$EXTRAS] $($PY -m vc_compile --version | cut -d' ' -f2)," \
     "$($PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
