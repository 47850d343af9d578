"""The opening of a study's results file, written from its committed reports (issue 46: "replication_qwen1.5b.md
leads with Tables 1-4 and Figure 3 ... and a plain list: which of the paper's claims hold, are reversed, or are
unresolved").

    python bench/study_lead.py --md bench/results/replication_qwen1.5b.md \\
        --report bench/results/replication_qwen1.5b_report \\
        [--without bench/results/replication_qwen1.5b_report_without_diverged] --label "after session 10"

What it writes sits between two marker lines right under the file's title, and a second run replaces it: the paper's
Tables 1-4 as the report wrote them (each cell "mean ± std (n)" over seeds), Figure 3 (the report's plot), and the
report's list of the paper's claims with their verdicts; with `--without` (the same study without the runs whose
training diverged, `clozemath report --exclude-diverged`), the tables' cells that leaving them out changes, beside
their values with all runs, and that report's list of claims. Nothing in it is typed by hand, so the file quotes only
committed tables.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from clozemath.errors import ClozeMathError
from clozemath.files import write_text_atomic
from clozemath.report.command import SUMMARY_FILE
from clozemath.report.figure import FIGURE_FILE

START = "<!-- study-lead: written by bench/study_lead.py from the committed reports; edit those, not this -->"
END = "<!-- study-lead: end -->"
PAPER_TABLE = re.compile(r"^\*\*Table [1-4]:")
CLAIMS = "**The paper's claims on "


def blocks(text: str) -> list[str]:
    """A report's markdown as its blocks: each starts at a bold title line."""
    found: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("**") or not found:
            found.append([])
        found[-1].append(line)
    return ["\n".join(block).strip() for block in found]


def read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ClozeMathError(f"{path}: cannot be read ({exc.strerror or exc}); a folder `clozemath report` wrote?") \
            from None


def paper_tables(report: Path) -> list[str]:
    tables = [block for block in blocks(read(report / "tables.md")) if PAPER_TABLE.match(block)]
    if not tables:
        raise ClozeMathError(f"{report / 'tables.md'}: no paper's table (Table 1-4) in it")
    return tables


def cells(table: str) -> dict[tuple[str, str], str]:
    """A paper's table as {(row, column): cell}: a row named by its label columns (those not right-aligned), a column
    by its header; bold (the best mean) left out."""
    lines = [line.strip().strip("|").split("|") for line in table.splitlines() if line.startswith("|")]
    if len(lines) < 2:
        return {}
    header, align, *rows = [[cell.strip() for cell in line] for line in lines]
    labels = [i for i, mark in enumerate(align) if not mark.endswith(":")]
    return {(" / ".join(row[i] for i in labels), header[i]): row[i].replace("**", "")
            for row in rows for i in range(len(row)) if i not in labels}


def changed_cells(report: Path, without: Path) -> str:
    """The paper's tables' cells that leaving the diverged runs out changes, both ways, as one table."""
    def by_title(folder: Path) -> dict[str, dict[tuple[str, str], str]]:
        return {table.split(":", 1)[0].strip("*"): cells(table) for table in paper_tables(folder)}

    every, kept = by_title(report), by_title(without)
    pairs = [(title, row, column, cell, kept.get(title, {}).get((row, column), "-"))
             for title, table in every.items() for (row, column), cell in table.items()]
    rows = [f"| {' | '.join(pair)} |" for pair in pairs if pair[3] != pair[4]]
    if not rows:
        return "Leaving them out changes no cell of Tables 1-4."
    return "\n".join(["The cells of Tables 1-4 that leaving them out changes (mean ± std over seeds, their count):", "",
                      "| Table | Row | Column | All runs | Without the diverged |", "| --- | --- | --- | ---: | ---: |",
                      *rows])


def claims(report: Path) -> str:
    found = [block for block in blocks(read(report / SUMMARY_FILE)) if block.startswith(CLAIMS)]
    if not found:
        raise ClozeMathError(f"{report / SUMMARY_FILE}: no list of the paper's claims in it")
    return "\n\n".join(found)


def lead(md: Path, report: Path, without: Path | None, label: str) -> str:
    """The opening section, its links relative to the results file."""
    def link(path: Path) -> str:
        return Path(os.path.relpath(path, md.parent)).as_posix()

    parts = [START, f"## The paper at this scale, {label}", "",
             f"Written from [`{link(report)}/`]({link(report / 'tables.md')}) (every table, interval and run there)."
             " Each cell: accuracy (%), mean ± std over training seeds (their count); bold: the best mean of its"
             " comparison.", "", *(f"{table}\n" for table in paper_tables(report))]
    figure = report / FIGURE_FILE
    if figure.is_file():
        parts += [f"**Figure 3: accuracy against training steps** (GSM8K, the same problems at every tenth of the "
                  f"steps)\n\n![Figure 3]({link(figure)})\n"]
    parts += [claims(report), ""]
    if without is not None:
        parts += [f"**Without the runs whose training diverged** ([`{link(without)}/`]({link(without / SUMMARY_FILE)}),"
                  " `clozemath report --exclude-diverged`):", "", changed_cells(report, without), "",
                  claims(without), ""]
    return "\n".join([*parts, END])


def with_lead(text: str, section: str) -> str:
    """The results file with `section` under its title line, replacing an earlier one."""
    if START in text:
        before, rest = text.split(START, 1)
        if END not in rest:
            raise ClozeMathError(f"the results file holds the lead's start marker but not its end ({END})")
        return before + section + rest.split(END, 1)[1]
    title, _, rest = text.partition("\n")
    return f"{title}\n\n{section}\n\n{rest.lstrip(chr(10))}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--md", type=Path, required=True, help="the study's results file")
    parser.add_argument("--report", type=Path, required=True, help="the study's report folder (clozemath report)")
    parser.add_argument("--without", type=Path, help="its report without the diverged runs (--exclude-diverged)")
    parser.add_argument("--label", default="so far", help='what the heading says of the results ("after session 10")')
    args = parser.parse_args(argv)
    try:
        section = lead(args.md, args.report, args.without, args.label)
        write_text_atomic(args.md, with_lead(read(args.md), section))
    except ClozeMathError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.md}: the lead written from {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
