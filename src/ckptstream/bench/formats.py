"""Byte units, and the formats of the benchmark's progress lines and printed tables."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches, one decimal: "16.0 MiB"."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def short_number(value: float) -> str:
    """Two decimals from 1 on, three significant digits below, so that a small figure (the
    rates of 20,000 x 1 KiB tensors) is never rounded to zero."""
    return f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def table(headers: list[str], lines: list[list[str]]) -> list[str]:
    """A plain text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]

    def fmt(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    return [fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(line) for line in lines]
