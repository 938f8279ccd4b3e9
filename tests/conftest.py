"""Shared test set-up.

* ``requires_cuda``: the one marker for GPU-only tests; they are skipped cleanly on CPU machines.
* Without a GPU, Triton kernels run under the interpreter (``TRITON_INTERPRET=1``) on small shapes. The
  variable must be set before ``triton`` is imported, so it is set here, in tests only. The interpreter's
  ``tl.reduce`` with a user combine function is vectorised there (tests/triton_interp.py: same left fold,
  same bits, ~100x faster).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import vc_compile.ops  # noqa: E402,F401  (``import vc_compile`` is lazy: tests call torch.ops.vcattn.* directly)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    import triton_interp  # noqa: E402

    triton_interp.install()
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def fresh_vcattn():
    """A clean slate for tests that compile: no Dynamo caches, no vcattn state/sites, no counters."""
    import vc_compile
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    vc_compile.reset(report=True)
    counters.clear()
    yield
    torch._dynamo.reset()
    vc_compile.reset(report=True)
