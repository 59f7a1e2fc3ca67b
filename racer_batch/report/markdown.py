"""The one Markdown table writer: job reports (report/build.py), ``racer-batch bench`` and the benchmark harness
(``benchmarks/``) all write their tables through :func:`md_table`."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence


def md_cell(value: Any) -> str:
    """A table cell: ``None`` is empty, a float keeps at most 3 decimals, a pipe is escaped.

    >>> [md_cell(None), md_cell(1.23456), md_cell(2.0), md_cell("a|b"), md_cell(7)]
    ['', '1.235', '2', 'a\\\\|b', '7']
    """
    if value is None:
        return ""
    if isinstance(value, float):
        text = f"{value:.3f}".rstrip("0").rstrip(".")
        return text if text not in ("", "-0") else "0"
    return str(value).replace("|", "\\|")


def md_table(head: Sequence[str], body: Iterable[Sequence[Any]]) -> str:
    """A GitHub Markdown table: ``head`` the column names, ``body`` one sequence of cells per row (any values;
    see :func:`md_cell`).

    Raises:
        ValueError: a row with another number of cells than ``head``.

    >>> print(md_table(["a", "b"], [[1, None], ["x", 0.5]]))
    | a | b |
    |---|---|
    | 1 |  |
    | x | 0.5 |
    """
    head = [str(h) for h in head]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in body:
        cells = [md_cell(c) for c in row]
        if len(cells) != len(head):
            raise ValueError(f"a row of {len(cells)} cells under {len(head)} columns: {cells}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def md_records(rows: Mapping[str, Mapping[str, Any]], cols: Sequence[str], *, key: str = "method") -> str:
    """One row per ``rows`` item (its name in the first column ``key``), the ``cols`` of each as cells."""
    return md_table([key, *cols], [[name, *(r.get(c) for c in cols)] for name, r in rows.items()])
