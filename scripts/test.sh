#!/usr/bin/env bash
# The test command (README quick start, CI): installs what the tests need, then runs them.
# On a CPU-only machine the Triton kernels run under TRITON_INTERPRET=1 on small shapes and GPU-only
# tests are skipped (marker `requires_cuda`). About 4-15 minutes on 2 CPU cores, by the machine's load
# (`bash .ci/run` on a clean clone: 5 min 40 s of tests, 1165 passed, 325 skipped, 2026-12-04, installs already
# present; 14 min 51 s of tests on 2026-12-02 under load; serially about twice that).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh  # pip install -e ".[test,demo]" (torch kept)
# -n auto: one pytest-xdist worker per core on a CPU-only machine, serial on a CUDA one (tests/conftest.py;
# it also splits torch's threads among the workers and keeps each module-scoped fixture on one worker:
# --dist loadgroup); `bash scripts/test.sh -n 0` runs serially.
exec ${PYTHON:-python3} -m pytest -q -ra --durations=15 -n auto --dist loadgroup tests "$@"
