"""The one plain-text table printer (``vc_compile.report()``, ``python -m vc_compile tune``, benchmarks).

``format_table(rows, cols)``: rows are dicts (cells looked up by column name) or sequences (cells in column
order); cells are formatted by ``fmt`` (default: floats with 6 significant digits, everything else
``str``), columns left-aligned and padded to their widest cell, a ``-+-`` rule under the header.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence, Union

Row = Union[Mapping[str, Any], Sequence[Any]]


def fmt_cell(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.6g}" if math.isfinite(x) else str(x)
    return "" if x is None else str(x)


def format_table(rows: Sequence[Row], cols: Sequence[str], fmt: Callable[[Any], str] = fmt_cell) -> str:
    cells = [[fmt(r.get(c, "")) for c in cols] if isinstance(r, Mapping) else [fmt(x) for x in r] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(x.ljust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
