#!/usr/bin/env bash
# The main job (README quick start): installs what it needs, then runs the demo. On a CPU-only machine
# it runs a reduced version through the reference paths and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
VC_EXTRAS=${VC_EXTRAS-demo} bash tools/setup.sh  # pip install -e ".[demo]" (torch kept)
exec ${PYTHON:-python3} -m vc_compile.demo "$@"
