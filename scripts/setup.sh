#!/usr/bin/env bash
# Installs what vc_compile needs on a fresh machine, without replacing a suitable torch.
# A CPU machine gets torch 2.13.0 (CPU build; a plain `torch` would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if v >= (2, 11) else 1)' 2>/dev/null; then
  echo "[setup] installing torch==2.13.0"
  $PY -m pip install -q torch==2.13.0
fi
$PY -c 'import triton' 2>/dev/null || $PY -m pip install -q triton==3.6.0
$PY -m pip install -q "sympy" "nvidia-ml-py" "diffusers==0.42.1" "transformers" "safetensors" "pillow" "numpy" "pytest"
$PY -m pip install -q --no-deps -e .
echo "[setup] ok: $($PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
