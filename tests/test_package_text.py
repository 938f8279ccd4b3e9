"""The package's comments and docstrings speak of the code: no commit hashes, dates or references to files
outside the repository. Measurements, with the GPU, date and commit that produced them, live in the design
records (docs/design/); a comment names the record.

What is scanned: every comment and string literal of ``vc_compile/**/*.py`` (found with ``tokenize``, so code
such as ``0x7FFFF`` or ``12582912.0`` is never looked at) and the package's Markdown files. The rules and why
each has no false positive on real constants:

* ISO date ``20YY-MM-DD``: no constant of the code has that shape (a date is never a tile size or a threshold).
* Commit hash: a run of 7 to 40 lowercase hex digits holding at least one digit AND at least one letter a-f,
  standing alone (not inside an identifier, a decimal number or a ``0x`` literal). Git's abbreviated hashes are
  7+ characters; a pure number (``2147483648``) has no letter, an English word or identifier has letters beyond
  f or sits inside a longer name, and hex constants in kernels are spelt with ``0x`` (excluded) and in code, not
  in comments. A token right after the word "commit" is flagged whatever its letters.
* ``SPEC <n>``: a section of a specification file that does not ship with the package. ``SPEC_FLAGS`` (a class
  attribute) has no space and digit after it.
"""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vc_compile"

DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
HASH = re.compile(r"(?<![0-9A-Za-z_.])(?!0x)(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
COMMIT_HASH = re.compile(r"\bcommits?\b[\s:,(]*(?:at\s+)?([0-9a-f]{7,40})\b", re.IGNORECASE)
SPEC = re.compile(r"\bSPEC\s+\d")


def _text_parts(path: Path):
    """(line, text) of each comment and string literal of a Python file; the whole text of anything else."""
    src = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        for i, line in enumerate(src.splitlines(), 1):
            yield i, line
        return
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            for j, line in enumerate(tok.string.splitlines()):
                yield tok.start[0] + j, line


def _sources():
    files = sorted(PACKAGE.rglob("*.py")) + sorted(PACKAGE.rglob("*.md"))
    assert files, PACKAGE
    return files


def find_offences(path: Path):
    out = []
    for line_no, text in _text_parts(path):
        for rule, rx in (("date", DATE), ("commit hash", HASH), ("commit hash", COMMIT_HASH), ("SPEC ref", SPEC)):
            for m in rx.finditer(text):
                out.append(f"{path.relative_to(PACKAGE.parent)}:{line_no}: {rule}: {m.group(0)!r}")
    return out


def test_rules_catch_what_they_should_and_nothing_else():
    hits = lambda s: [r for r, rx in (("d", DATE), ("h", HASH), ("c", COMMIT_HASH), ("s", SPEC)) if rx.search(s)]
    assert hits("# measured 2026-12-04") == ["d"]
    assert hits("# (H200, fcce80f): slower") == ["h"]
    assert hits("# commit 64658bb") == ["h", "c"]
    assert hits("# commit 1234567") == ["c"]
    assert hits('"""Preprocessing (SPEC 3.1)."""') == ["s"]
    for fine in ("# 0x7FFFF + lsb", "# 12582912.0 = 1.5 * 2^23", "# 2147483648", "# e4m3 codes, fp8e4nv",
                 "# SPEC_FLAGS letters", "# rel. L2 6.203e-3", "# decade", "# 9223372036854775807",
                 "# _ab12cd34ef_name", "# feedface"):
        assert hits(fine) == [], fine


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_package_text_has_no_dates_hashes_or_outside_refs(path):
    offences = find_offences(path)
    assert not offences, ("measurements' dates and commits belong in docs/design/, and references in the "
                          "repository:\n" + "\n".join(offences))
