"""Runs a script against the offline sm_90 harness (tests/codegen_stats.py's fake driver: kernels built for
sm_90, nothing launched) in a fresh process, outside the interpreter the test session runs under."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def result_line(code: str) -> tuple:
    """(the script's ``RESULT ...`` line or "", its output tails for an assertion message); skips the test where
    this machine cannot compile for sm_90 offline."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    # NOTE the session's Triton cache, not one per test: the same sm_90 builds served the codegen fixtures and the
    # other scripts (a build read from the cache is a new kernel object to the script, as a compiled one is)
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=1200)
    if "No module named" in r.stderr or (r.returncode != 0 and "GPUTarget" in r.stderr):
        pytest.skip(f"offline sm_90 compile unavailable here: {r.stderr.strip()[-300:]}")
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), "")
    return line, r.stdout[-2000:] + r.stderr[-3000:]
