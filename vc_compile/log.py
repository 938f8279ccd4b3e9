"""The ``vc_compile`` logger and the progress bar of long work.

Every module logs to ``logging.getLogger("vc_compile")`` (or a child, ``vc_compile.tune``, ...): warnings
reach stderr through Python's last-resort handler like any library's; INFO (what ``enable()`` compiled,
which launch configuration tuning chose) shows once the application configures logging, e.g.
``logging.basicConfig(level=logging.INFO)``, or with ``vc_compile.log.to_stderr()``. User mistakes that
need a code change stay ``warnings.warn`` (so tests and ``-W error`` see them).

Long work (kernel tuning on first use) shows a ``tqdm`` bar when tqdm is installed (it comes with
diffusers): it stacks under a running diffusers progress bar instead of writing into it, and disappears
when done; without tqdm, one INFO line per kernel.
"""
from __future__ import annotations

import logging
import sys
from typing import Optional

logger = logging.getLogger("vc_compile")


def get_logger(name: str) -> logging.Logger:
    """The ``vc_compile.<name>`` child logger (``name`` may be a module's ``__name__``)."""
    return logging.getLogger(name if name.startswith("vc_compile") else f"vc_compile.{name}")


def to_stderr(level: int | str = logging.INFO) -> logging.Handler:
    """Show vc_compile's messages at ``level`` and above on stderr (one handler, however often called)."""
    for h in logger.handlers:
        if getattr(h, "_vc_compile", False):
            h.setLevel(level)
            logger.setLevel(level)
            return h
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    h._vc_compile = True  # type: ignore[attr-defined]
    h.setLevel(level)
    logger.addHandler(h)
    logger.setLevel(level)
    return h


class Progress:
    """``update(ok)`` once per unit of work, ``close()`` at the end: a tqdm bar (``leave=False``) when tqdm
    is importable, else nothing per unit and one INFO line at the end."""

    def __init__(self, total: int, desc: str, log: Optional[logging.Logger] = None):
        self.total, self.desc, self.done, self.failed = total, desc, 0, 0
        self.log = log or logger
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        self.bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr) if tqdm else None
        if self.bar is None:
            self.log.info("%s: %d to run", desc, total)

    def update(self, ok: bool = True, note: str = "") -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
