"""The toolchain this package supports, and what it says when the installed one is outside it.

``SUPPORTED_TRITON`` is the range of Triton releases every kernel is built and tested on (the CPU suite in CI on
the oldest and the newest, the offline sm_90 build of every kernel on each: ``tools/triton_versions.py``).
torch pins its Triton (2.11 -> 3.6, 2.13 -> 3.7, 2.14 -> 3.8, 2.15 -> 3.9), so the range also names the torch
releases that bring a supported Triton. Outside it nothing is refused: the kernels are tried, a kernel that does
not build falls back to the next path (``kernels/dispatch.py``: the Gluon sm_90 kernel -> the Triton kernel ->
stock SDPA) with one warning, and ``check()`` warns once at compile time that the toolchain is untested.
"""
from __future__ import annotations

import functools
import re
import warnings
from typing import Optional, Tuple

SUPPORTED_TRITON: Tuple[Tuple[int, int], Tuple[int, int]] = ((3, 6), (3, 9))
SUPPORTED_TORCH: Tuple[Tuple[int, int], Tuple[int, int]] = ((2, 11), (2, 15))


def _parse(version: str) -> Tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _span(r) -> str:
    return f"{r[0][0]}.{r[0][1]}-{r[1][0]}.{r[1][1]}"


@functools.lru_cache(maxsize=None)
def triton_version() -> Optional[str]:
    """The installed Triton's version, or None where Triton does not import."""
    try:
        import triton
    except Exception:  # noqa: BLE001 - no Triton (or a broken one): the reference paths run
        return None
    return triton.__version__


def triton_supported(version: Optional[str] = None) -> bool:
    version = version if version is not None else triton_version()
    return version is not None and SUPPORTED_TRITON[0] <= _parse(version) <= SUPPORTED_TRITON[1]


def fix(version: Optional[str] = None) -> str:
    """What to do about a kernel that did not build on Triton ``version``: use a supported Triton, or report it."""
    version = version if version is not None else triton_version()
    if not triton_supported(version):
        return (f"vc_compile is tested on Triton {_span(SUPPORTED_TRITON)} (the Triton of torch "
                f"{_span(SUPPORTED_TORCH)}): install one of those torch releases, or a vc_compile release that "
                f"supports Triton {version}")
    return ("Triton {} is supported, so this is a bug: please report it with the warning's text and "
            "vc_compile.report()").format(version)


def untested_reason() -> Optional[str]:
    """Why the installed toolchain is outside what this package is tested on, or None."""
    version = triton_version()
    if version is not None and not triton_supported(version):
        return (f"Triton {version} is outside the tested range {_span(SUPPORTED_TRITON)}: a kernel that does not "
                "build falls back to a slower path (Gluon sm_90 -> Triton -> stock SDPA) with a warning")
    return None


# Kernels whose GPU test fails on a supported Triton, the cause not found yet: (Triton (major, minor), kernel,
# ExpCast, head dim) -> what failed. The op leaves the calls that would run them on a GPU to stock SDPA (ops.py),
# warned once and reported, until the failure is understood; the CPU reference path is not affected.
KNOWN_FAILURES = {
    ((3, 9), "vsmooth_attn", False, 64): (
        "on Triton 3.9 the Triton V-Smooth kernel (the path off sm_90 and with FP8 Q/K) without ExpCast at head dim "
        "64 returns Inf on an H100 for sequences with a key tail (100 and 4173 tokens), where the Gluon sm_90 "
        "kernel and the reference agree; the cause is not found yet"),
}


@functools.lru_cache(maxsize=1)
def has_known_failures() -> bool:
    """Whether KNOWN_FAILURES lists anything for the installed Triton (the op asks nothing more where not)."""
    version = triton_version()
    return version is not None and any(key[0] == _parse(version) for key in KNOWN_FAILURES)


@functools.lru_cache(maxsize=64)
def known_failure(kernel: str, expcast: bool, head_dim: int) -> Optional[str]:
    """Why the installed Triton cannot be trusted with this kernel at this head dim (KNOWN_FAILURES), or None."""
    version = triton_version()
    if version is None:
        return None
    return KNOWN_FAILURES.get((_parse(version), kernel, bool(expcast), int(head_dim)))


@functools.lru_cache(maxsize=None)
def check(fast_path_off: Optional[str] = None) -> Optional[str]:
    """Warn once per process, at compile time, where the toolchain is untested (see ``untested_reason``) or where
    the fast host path is off on it (``fast_path_off``: why, from ``kernels/launch.py``'s ``fast_path_off()``, which
    the caller reads: this module imports nothing of the package); returns what was said."""
    said = [x for x in (untested_reason(), fast_path_off) if x]
    if said:
        extra = (" The remembered kernel launches are off: each reuse call goes through Triton's launch path "
                 "(more host time per call)." if fast_path_off else "")
        warnings.warn(f"vcattn: {'; '.join(said)}.{extra} {fix()}.", RuntimeWarning, stacklevel=3)
    return "; ".join(said) or None
