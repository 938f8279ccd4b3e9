#!/usr/bin/env bash
# The test command (README quick start, CI): installs what the tests need into a virtual environment of its own
# (.venv-test, over the system's packages: an installed torch is reused, and the test-only packages such as
# torchao never reach the user's environment), then runs the tests.
# On a CPU-only machine the Triton kernels run under TRITON_INTERPRET=1 on small shapes and GPU-only
# tests are skipped (marker `requires_cuda`). About 7-11 minutes on 2 CPU cores alone, by machine: on a new
# machine (no torch, empty Triton and Inductor caches) 7 min 18 s, setup 55 s (2026-12-07); 10 min 22 s on an
# earlier machine of the same size; less with the caches of an earlier run; longer while another job shares them.
#     bash tools/test.sh [pytest args]        # VC_TEST_VENV=DIR: another venv; VC_TEST_VENV=none: this Python
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VC_TEST_VENV:-.venv-test}
if [ "$VENV" != none ]; then
  [ -x "$VENV/bin/python" ] || ${PYTHON:-python3} -m venv --system-site-packages "$VENV"
  export PYTHON="$PWD/$VENV/bin/python"
fi
bash tools/setup.sh  # pip install -e ".[test,demo]" (torch kept)
# -n auto: one pytest-xdist worker per core on a CPU-only machine, serial on a CUDA one (tests/conftest.py;
# it also splits torch's threads among the workers and keeps each module-scoped fixture on one worker:
# --dist loadgroup); `bash tools/test.sh -n 0` runs serially.
# The pytest plugins the suite does not use (hypothesis, pytest-benchmark, anyio: installed beside it on some
# machines) stay unloaded: about 3 s of every worker's start.
exec ${PYTHON:-python3} -m pytest -q -ra --durations=15 -n auto --dist loadgroup \
  -p no:hypothesispytest -p no:benchmark -p no:anyio tests "$@"
