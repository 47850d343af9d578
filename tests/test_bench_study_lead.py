"""`bench/study_lead.py`: the opening of a study's results file written from its committed reports (the paper's
Tables 1-4, Figure 3, the claims with their verdicts), under the file's title, replaced by a second run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("bench_study_lead", ROOT / "bench" / "study_lead.py")
study_lead = importlib.util.module_from_spec(SPEC)
sys.modules["bench_study_lead"] = study_lead
SPEC.loader.exec_module(study_lead)

CLAIMS = "**The paper's claims on Tiny** (here: ...)\n- Hold, 1:\n  - Table 1: MFT > Base. Here: +9.29 [+6.77, +11.86]."


def write_report(folder: Path, cell: str, claims: str = CLAIMS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tables.md").write_text(
        "**Results: Tiny trained on GSM8K**\n\n| Method | GSM8K greedy |\n| --- | ---: |\n| IT | 55.57 ± 0.61 (5) |\n\n"
        f"**Table 1: overall accuracy**\n\n| Training set | Method | Tiny |\n| --- | --- | ---: |\n| GSM8K | MFT | {cell} |"
        "\n\n**Table 4: ablations (GSM8K)**\n\n| Method | Tiny |\n| --- | ---: |\n| ClozeMath | 45.05 ± 25.21 (5) |\n\n"
        "**Compute: steps and tokens trained per trial**\n\n| Training set |\n| --- |\n| GSM8K |\n")
    (folder / "summary.md").write_text(f"**The paper's orderings on GSM8K beam (Tiny)**\n- Hold, 1: IT > MFT.\n\n{claims}\n")
    (folder / "accuracy_vs_steps.png").write_bytes(b"\x89PNG")
    return folder


def test_the_lead_holds_the_papers_tables_figure_and_claims_and_a_second_run_replaces_it(tmp_path: Path) -> None:
    results = tmp_path / "results"
    report = write_report(results / "study_report", "**57.89 ± 1.21 (5)**")
    without = write_report(results / "study_without", "58.00 ± 1.00 (4)", CLAIMS.replace("Hold", "Reversed"))
    md = results / "study.md"
    md.write_text("# The study\n\n## Plan\n\nThe sessions.\n")
    argv = ["--md", str(md), "--report", str(report), "--without", str(without), "--label", "after session 10"]
    assert study_lead.main(argv) == 0
    text = md.read_text()
    title, lead, body = text.split("\n\n", 1)[0], text[text.index(study_lead.START):], text.split(study_lead.END)[1]
    assert title == "# The study" and body == "\n\n## Plan\n\nThe sessions.\n"
    assert "## The paper at this scale, after session 10" in lead
    assert "| GSM8K | MFT | **57.89 ± 1.21 (5)** |" in lead and "| ClozeMath | 45.05 ± 25.21 (5) |" in lead
    assert "**Results" not in lead and "**Compute" not in lead and "orderings" not in lead  # the paper's tables alone
    assert "![Figure 3](study_report/accuracy_vs_steps.png)" in lead  # relative to the results file
    assert lead.index("- Hold, 1:") < lead.index("**Without the runs whose training diverged**") < \
        lead.index("- Reversed, 1:")
    assert "(study_without/summary.md)" in lead
    # the cells leaving the diverged runs out changes, both values, bold dropped; an unchanged cell is not listed
    assert "| Table 1 | GSM8K / MFT | Tiny | 57.89 ± 1.21 (5) | 58.00 ± 1.00 (4) |" in lead
    assert lead.count("45.05 ± 25.21 (5)") == 1

    write_report(report, "**59.00 ± 1.00 (5)**")
    assert study_lead.main(argv) == 0
    again = md.read_text()
    assert again.count(study_lead.START) == 1 and "59.00 ± 1.00 (5)" in again and "57.89" not in again
    assert again.endswith("## Plan\n\nThe sessions.\n")
    assert study_lead.main(argv) == 0 and md.read_text() == again  # the same reports: the same file

    write_report(without, "**59.00 ± 1.00 (5)**")
    assert study_lead.main(argv) == 0
    assert "Leaving them out changes no cell of Tables 1-4." in md.read_text() and "| Table 1 |" not in md.read_text()


def test_a_folder_that_is_no_report_and_a_broken_lead_are_one_line_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    md = tmp_path / "study.md"
    md.write_text("# The study\n")
    assert study_lead.main(["--md", str(md), "--report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tmp_path / 'missing' / 'tables.md'}: cannot be read" in err
    report = write_report(tmp_path / "report", "50.00 (1)")
    md.write_text(f"# The study\n\n{study_lead.START}\nhalf a lead\n")
    assert study_lead.main(["--md", str(md), "--report", str(report)]) == 2
    assert "not its end" in capsys.readouterr().err and md.read_text().endswith("half a lead\n")  # left as it was
