"""Plain-text tables for the terminal: first column left-aligned, the others right-aligned."""

from __future__ import annotations

from collections.abc import Sequence


def render(head: str, rows: Sequence[Sequence[str]]) -> str:
    """`rows[0]` is the header row; a rule goes under it."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [head]
    for k, row in enumerate(rows):
        lines.append("  " + "  ".join(c.rjust(w) if i else c.ljust(w)
                                      for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        if k == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines)
