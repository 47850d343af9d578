"""A table of accuracies over seeds (each cell "mean ± std (n)", the best means bold) or of ready-made cells, rendered
as markdown or LaTeX."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


def spread(values: list[float]) -> str:
    """The cell "mean ± std (n)" over seeds (the sample std; a single seed has none)."""
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.2f} (1)"
    return f"{statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f} ({len(values)})"


@dataclass
class Table:
    title: str
    header: list[str]
    labels: list[list[str]]
    """The label cells of each row (training set, method, ...)."""
    cells: list[list[list[float]]]
    """Each seed's accuracy in percent, per row and value column; empty where no run measured it."""
    groups: list[list[tuple[int, int]]] = field(default_factory=list)
    """Cells (row, value column) compared with each other: the best mean of each group is bold."""

    @property
    def values(self) -> list[list[float | None]]:
        """The mean over seeds of each cell (None: none measured it)."""
        return [[statistics.fmean(seeds) if seeds else None for seeds in row] for row in self.cells]

    def bold(self) -> set[tuple[int, int]]:
        best, values = set(), self.values
        for group in self.groups:
            present = [((r, c), values[r][c]) for r, c in group if values[r][c] is not None]
            if present:
                top = max(round(value, 2) for _, value in present)
                best |= {cell for cell, value in present if round(value, 2) == top}
        return best


@dataclass
class TextTable:
    """A table of ready-made cells: the first `labels` columns are labels, the others values."""

    title: str
    header: list[str]
    labels: int
    rows: list[list[str]]


def _as_text(table: Table, bold: str) -> TextTable:
    """The table's cells as text, the best of each group through `bold` (a format string)."""
    best = table.bold()
    rows = [[*label, *(bold.format(spread(seeds)) if (r, c) in best else spread(seeds) for c, seeds in enumerate(row))]
            for r, (label, row) in enumerate(zip(table.labels, table.cells))]
    labels = len(table.header) - len(table.cells[0]) if table.cells else len(table.header)
    return TextTable(table.title, table.header, labels, rows)


def to_markdown(table: Table | TextTable) -> str:
    text = table if isinstance(table, TextTable) else _as_text(table, "**{}**")
    lines = [f"**{text.title}**", "", "| " + " | ".join(text.header) + " |",
             "| " + " | ".join(["---"] * text.labels + ["---:"] * (len(text.header) - text.labels)) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in text.rows]
    if not text.rows:
        lines.append("| " + " | ".join(["(no runs)"] + [""] * (len(text.header) - 1)) + " |")
    return "\n".join(lines)


LATEX_CHARACTERS = {
    "&": r"\&", "%": r"\%", "_": r"\_", "–": "--", "±": r"$\pm$", "Δ": r"$\Delta$", "×": r"$\times$",
}


def _latex_escape(text: str) -> str:
    return "".join(LATEX_CHARACTERS.get(character, character) for character in text)


def to_latex(table: Table | TextTable) -> str:
    text = table if isinstance(table, TextTable) else _as_text(table, r"\textbf{{{}}}")
    spec = "l" * text.labels + "c" * (len(text.header) - text.labels)
    lines = [f"% {text.title}", rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(rf"\textbf{{{_latex_escape(h)}}}" for h in text.header) + r" \\", r"\midrule"]
    lines += [" & ".join(map(_latex_escape, row)) + r" \\" for row in text.rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines)
