"""The spread over seeds, the intervals and the verdicts of `clozemath report` (no Ray), end to end on an MLflow
store whose trials logged their predictions (the interval module alone: `test_intervals.py`)."""

from __future__ import annotations

import gzip
import json
import math
import statistics
from pathlib import Path

import pytest

from clozemath import tracking
from clozemath.claims import Comparison, orderings_paragraph, paper_pairs, verdict
from clozemath.config import TrackingConfig
from clozemath.intervals import problems_difference, seeds_difference
from clozemath.report import REPLICATION_METHODS, TrialResult, grading_tables
from clozemath_cli import main


def right_on(count: int, problems: int, offset: int = 0) -> dict[str, bool]:
    """Correctness on `problems` problems `p000`...: right on `count` of them, from `offset` on."""
    return {f"p{i:03d}": offset <= i < offset + count for i in range(problems)}


# --------------------------------------------------------------------------------------------------------------
# The report on logged predictions

PROBLEMS = 400
OFFSETS = {"0": 0, "1": 4, "2": 12}
"""Seed s of IT is right on problems [0, 120 + offset), of MFT on the same, of ClozeMath on [0, 160 + offset)."""
RIGHT = {"it": 120, "mft": 120, "clozemath": 160}
BASE_RIGHT = 80
NO_PREDICTIONS = 0.35
"""random_span logs this accuracy but no predictions."""


def log_trial(config: TrackingConfig, parent: str, method: str, seed: str, folder: Path) -> None:
    tags = {"model": "smollm2-135m", "method": method, "train_set": "gsm8k", "seed": seed, "role": "trial"}
    run = tracking.start_run(config, f"replication/{method},{seed}", parent, tags)
    run.log_params({"train.lr": 3e-4})
    if method == "random_span":
        accuracy = NO_PREDICTIONS
    else:
        right = BASE_RIGHT if method == "base" else RIGHT[method] + OFFSETS[seed]
        correctness = right_on(right, PROBLEMS)
        ids = list(correctness)
        if method != "it":  # listed in another order than the reference's file
            ids = ids[::-1] if method == "clozemath" else ids[1::2] + ids[::2]
        # A generation holding U+2028, written as the evaluator writes it (ensure_ascii=False): a line separator to
        # str.splitlines, not to JSONL (a real base-model generation broke the report this way).
        rows = [{"id": i, "dataset": "gsm8k", "decoding": "greedy", "generation": "so\u2028 7", "gold": "7",
                 "correct": correctness[i]} for i in ids]
        predictions = folder / method / seed / "predictions"
        predictions.mkdir(parents=True)
        (predictions / "gsm8k.jsonl").write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        run.log_artifacts(predictions.parent, "eval")  # as ray_jobs/eval_job.py logs them
        accuracy = right / PROBLEMS
    run.log_metrics(10, {
        "eval/gsm8k/greedy/accuracy": accuracy, "eval/gsm8k/greedy/correct": round(accuracy * PROBLEMS),
        "eval/gsm8k/greedy/total": PROBLEMS,
    })
    run.end()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> TrackingConfig:
    folder = tmp_path_factory.mktemp("replication")
    config = TrackingConfig(uri=f"sqlite:///{folder / 'mlruns.db'}", experiment="replication")
    parent = tracking.start_run(config, "replication", tags={"role": "grid"}).run_id
    log_trial(config, parent, "base", "0", folder)
    for method in ("it", "mft", "clozemath", "random_span"):
        for seed in OFFSETS:
            log_trial(config, parent, method, seed, folder)
    return config


def cells(text: str, *labels: str) -> list[str]:
    """The value cells of the markdown row whose label cells are `labels`."""
    for line in text.splitlines():
        found = [c.strip() for c in line.strip("|").split("|")]
        if found[: len(labels)] == list(labels):
            return found[len(labels):]
    raise AssertionError(f"no row {labels} in\n{text}")


def seed_accuracies(method: str) -> list[float]:
    return [100 * (RIGHT[method] + offset) / PROBLEMS for offset in OFFSETS.values()]


def test_report_shows_the_spread_over_seeds_and_which_differences_are_real(
    store: TrackingConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", "--experiment", "replication", "--tracking-uri", store.uri, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    results = out.split("**Results: SmolLM2-135M-Instruct trained on GSM8K")[1].split("**Comparisons")[0]
    assert "| Method | GSM8K greedy |" in results
    methods = [line.split("|")[1].strip() for line in results.splitlines() if line.startswith("| ")][2:]
    assert methods == ["Base", "IT", "MFT", "ClozeMath", "W/o Equation masking"]
    clozemath = seed_accuracies("clozemath")  # 40, 41, 43
    assert cells(results, "ClozeMath") == [
        f"{statistics.fmean(clozemath):.2f} ± {statistics.stdev(clozemath):.2f} (3)"]
    assert cells(results, "ClozeMath") == ["41.33 ± 1.53 (3)"]
    assert cells(results, "Base") == ["20.00 (1)"]  # one seed: no std
    assert cells(results, "W/o Equation masking") == ["35.00 ± 0.00 (3)"]

    comparisons = out.split("**Comparisons: SmolLM2-135M-Instruct trained on GSM8K")[1].split("**Grading")[0]
    assert ("| Evaluation | Method | vs | Δ (pp) | 95% interval, seeds and problems | Verdict | "
            "95% interval, problems only | Runs × problems |") in comparisons
    assert "provisional below 5 seeds" in comparisons
    # every pair the paper's numbers order (DeepSeek-Math-7B: ClozeMath 74.22 > IT 71.57 > W/o Equation masking
    # 71.19 > MFT 70.20 > Base 59.21), its better method first
    pairs = [tuple(line.split(" | ")[1:3]) for line in comparisons.splitlines() if line.startswith("| GSM8K greedy")]
    assert pairs == [("IT", "Base"), ("IT", "MFT"), ("IT", "W/o Equation masking"), ("MFT", "Base"),
                     ("ClozeMath", "Base"), ("ClozeMath", "IT"), ("ClozeMath", "MFT"),
                     ("ClozeMath", "W/o Equation masking"), ("W/o Equation masking", "Base"),
                     ("W/o Equation masking", "MFT")]

    # MFT is right exactly where IT is, seed by seed (its file lists the problems in another order). Over problems,
    # the trained models held fixed: 0 exactly. Over seeds: methods trained apart are not paired, so each side's
    # spread over its seeds (accuracies 30, 31, 33: variance 2.33e-4) counts, about 0 ± t(4) * sqrt(2 * 2.33e-4 / 3)
    # (Welch's 2 + 2 degrees of freedom; less the little seed-by-problem noise): ±3.5 points, 0 inside
    delta, over_seeds, judged, interval, runs = cells(comparisons, "GSM8K greedy", "IT", "MFT")
    assert (delta, judged, interval, runs) == ("+0.00", "holds 0, provisional: 3 seeds", "[+0.00, +0.00]",
                                               "3 and 3 × 400")
    low, high = (float(x) for x in over_seeds.strip("[]").split(", "))
    half_width = 2.776 * 100 * math.sqrt(2 * statistics.variance([0.30, 0.31, 0.33]) / 3)
    assert low == pytest.approx(-half_width, abs=0.4) and high == pytest.approx(half_width, abs=0.4)

    # ClozeMath - IT: 40 more right answers per seed, +10 points; per problem, the differences of the means over seeds
    # are 1/3 on 12 problems, 2/3 on 12, 1 on 28 (0 elsewhere): var = (12/9 + 48/9 + 28) / 400 - 0.1^2 = 0.07667, so
    # the interval over problems is about 10 ± 1.96 * sqrt(0.07667 / 400) = 10 ± 2.71 (ClozeMath's file is in
    # reverse order)
    delta, over_seeds, judged, interval, runs = cells(comparisons, "GSM8K greedy", "ClozeMath", "IT")
    assert (delta, judged, runs) == ("+10.00", "excludes 0, provisional: 3 seeds", "3 and 3 × 400")
    low, high = (float(x) for x in interval.strip("[]").split(", "))
    half_width = 196 * math.sqrt(0.07667 / PROBLEMS)
    assert low == pytest.approx(10 - half_width, abs=0.4) and high == pytest.approx(10 + half_width, abs=0.4)
    # over seeds too: both sides spread alike (40, 41, 43 and 30, 31, 33), about 10 ± 3.5 plus the problems' part
    low, high = (float(x) for x in over_seeds.strip("[]").split(", "))
    assert 4 < low < 10 < high < 16

    # against base, one untrained run against every seed: mean(40, 41, 43) - 20 and mean(30, 31, 33) - 20
    delta, over_seeds, judged, interval, runs = cells(comparisons, "GSM8K greedy", "ClozeMath", "Base")
    assert (delta, judged, runs) == (f"{statistics.fmean(clozemath) - 20:+.2f}", "excludes 0, provisional: 3 seeds",
                                     "3 and 1 × 400")
    for text in (over_seeds, interval):
        low, high = (float(x) for x in text.strip("[]").split(", "))
        assert low < statistics.fmean(clozemath) - 20 < high
    assert cells(comparisons, "GSM8K greedy", "IT", "Base")[0] == f"{statistics.fmean(seed_accuracies('it')) - 20:+.2f}"
    # no predictions logged: the difference of the means, said so, no interval
    no_interval = "– (no per-problem predictions: difference of the means)"
    assert cells(comparisons, "GSM8K greedy", "IT", "W/o Equation masking") == [
        f"{statistics.fmean(seed_accuracies('it')) - 35:+.2f}", no_interval, "–", "–", "–"]
    assert cells(comparisons, "GSM8K greedy", "W/o Equation masking", "Base") == [
        "+15.00", no_interval, "–", "–", "–"]

    # which of the paper's orderings hold, for the README (GSM8K beam not run: greedy); 3 seeds: provisional
    summary = (tmp_path / "summary.md").read_text()
    assert summary.strip() in out and "on GSM8K greedy (SmolLM2-135M-Instruct)" in summary
    assert "a verdict from fewer than 5 seeds of a trained method is provisional" in summary
    lines = summary.splitlines()
    held = next(line for line in lines if line.startswith("- Hold"))
    assert held.startswith("- Hold, 5: ") and "ClozeMath > IT (+10.00 [" in held and "IT > MFT" not in held
    assert held.count(", provisional: 3 seeds)") == 5
    unresolved = next(line for line in lines if line.startswith("- Not resolved"))
    assert unresolved.startswith("- Not resolved (the interval holds 0), 1: IT > MFT (+0.00 [-")
    assert unresolved.endswith(", provisional: 3 seeds).")
    untested = next(line for line in lines if "Not tested" in line)
    assert untested.startswith("- Not tested, 4: ") and "no interval: no per-problem predictions" in untested
    assert "Reversed" not in summary

    assert "**Table 2" not in out and "**Table 1" in out  # no CoT-decoding run: no Table 2
    assert (tmp_path / "tables.md").read_text().strip() in out

    trials = json.loads((tmp_path / "trials.json").read_text())
    assert len(trials) == 13 and {t["tags"]["method"] for t in trials} == {"base", *RIGHT, "random_span"}
    first = next(t for t in trials if t["run_name"] == "replication/clozemath,2")
    assert first["tags"]["seed"] == "2" and first["params"] == {"train.lr": "0.0003"}
    assert first["metrics"]["eval/gsm8k/greedy/accuracy"] == pytest.approx(0.43)
    assert first["metrics"]["eval/gsm8k/greedy/total"] == PROBLEMS and len(first["run_id"]) == 32


def test_latex_spells_the_spread_and_the_differences(store: TrackingConfig, tmp_path: Path, capsys) -> None:
    argv = ["report", "--experiment", "replication", "--tracking-uri", store.uri, "--out", str(tmp_path), "--latex"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert r"ClozeMath & 41.33 $\pm$ 1.53 (3) \\" in out
    assert r"\textbf{$\Delta$ (pp)}" in out
    assert r"& holds 0, provisional: 3 seeds & [+0.00, +0.00] & 3 and 3 $\times$ 400 \\" in out
    assert r"-- (no per-problem predictions: difference of the means) & -- & -- & --" in out
    assert (tmp_path / "tables.tex").is_file() and (tmp_path / "trials.json").is_file()


def test_trials_that_differ_in_another_axis_are_not_pooled_as_seeds(tmp_path: Path, capsys) -> None:
    """A learning-rate sweep (`axes: {method: [it], train.lr: [...]}`, one seed): a row per rate, none pooled."""
    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="sweep")
    parent = tracking.start_run(config, "sweep", tags={"role": "grid"}).run_id
    for lr, accuracy in (("0.0001", 0.1), ("0.001", 0.3)):
        trial = f"sweep/method=it,lr={lr}"
        tags = {"model": "smollm2-135m", "method": "it", "train_set": "gsm8k", "seed": "0", "role": "trial",
                "trial": trial}
        run = tracking.start_run(config, trial, parent, tags)
        run.log_metrics(1, {"eval/gsm8k/greedy/accuracy": accuracy})
        run.end()
    main(["report", "--experiment", "sweep", "--tracking-uri", config.uri, "--out", str(tmp_path / "out")])
    text = capsys.readouterr().out
    assert cells(text, "IT (lr=0.0001)") == ["10.00 (1)"] and cells(text, "IT (lr=0.001)") == ["30.00 (1)"]
    assert "(2)" not in text


def test_predictions_export_and_a_report_read_back_from_it(
    store: TrackingConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every trial's predictions in one gzipped file (10 trials logged 400 each; random_span none), prompts left out
    (compact: generations too); a report reads the per-problem answers from it instead of the artifacts: with
    ClozeMath's answers all made wrong there, ClozeMath - IT over the predictions is -mean(30, 31, 33) = -31.33."""
    argv = ["report", "--experiment", "replication", "--tracking-uri", store.uri]
    assert main([*argv, "--out", str(tmp_path / "full"), "--export-predictions"]) == 0
    with gzip.open(tmp_path / "full" / "predictions.jsonl.gz", "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    assert len(rows) == 10 * PROBLEMS and "prompt" not in rows[0] and rows[0]["generation"] == "so\u2028 7"
    assert {(r["method"], r["seed"]) for r in rows} == {("base", "0")} | {(m, s) for m in RIGHT for s in OFFSETS}
    assert sum(r["correct"] for r in rows if (r["method"], r["seed"]) == ("clozemath", "2")) == 160 + 12

    assert main([*argv, "--out", str(tmp_path / "compact"), "--export-predictions", "compact"]) == 0
    compact = tmp_path / "compact" / "predictions.jsonl.gz"
    with gzip.open(compact, "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    assert len(rows) == 10 * PROBLEMS and "generation" not in rows[0] and "prompt" not in rows[0]
    main([*argv, "--out", str(tmp_path / "again"), "--export-predictions", "compact"])
    assert (tmp_path / "again" / "predictions.jsonl.gz").read_bytes() == compact.read_bytes()  # no name nor time

    altered = tmp_path / "altered.jsonl.gz"
    with gzip.open(altered, "wt", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps({**row, "correct": row["correct"] and row["method"] != "clozemath"}) + "\n")
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "read"), "--predictions", str(altered)]) == 0
    comparisons = capsys.readouterr().out.split("**Comparisons")[1].split("**Grading")[0]
    assert cells(comparisons, "GSM8K greedy", "ClozeMath", "IT")[0] == "-31.33"
    assert main([*argv, "--predictions", str(tmp_path / "none.jsonl.gz")]) == 2
    assert "no such predictions export" in capsys.readouterr().err


def test_the_grading_table_shows_strict_lenient_cut_and_uncut_for_every_method() -> None:
    """Means over seeds, by hand: IT strict (10 + 20) / 2 = 15, cut (25 + 35) / 2 = 30; base (the harness) one seed,
    its flexible-extract (8%) beside its strict-match: every method under both rules."""
    def trial(method: str, seed: str, **stats: float) -> TrialResult:
        metrics = {f"eval/gsm8k/greedy/{name}": value for name, value in stats.items()}
        return TrialResult(f"{method}{seed}", "m", method, "gsm8k", seed, metrics)

    grading = {"accuracy": 0.3, "flexible_accuracy": 0.3, "lenient_accuracy": 0.36, "fallback_share": 0.2,
               "uncut_accuracy": 0.4}
    results = [trial("it", "0", strict_accuracy=0.1, cut_share=0.25, **grading),
               trial("it", "1", strict_accuracy=0.2, cut_share=0.35, **grading),
               trial("base", "0", accuracy=0.05, strict_accuracy=0.05, flexible_accuracy=0.08, lenient_accuracy=0.05)]
    (table,) = grading_tables(results)
    assert table.header == ["Evaluation", "Method", "Accuracy", "Strict", "Flexible", "Lenient", "Fallback share",
                            "Cut share", "Accuracy uncut"]
    assert table.rows == [["GSM8K greedy", "Base", "5.00", "5.00", "8.00", "5.00", "–", "–", "–"],
                          ["GSM8K greedy", "IT", "30.00", "15.00", "30.00", "36.00", "20.0", "30.0", "40.00"]]
    assert "the last number of an uncut generation" in table.title and "flexible-extract" in table.title


def test_the_paper_orders_pairs_by_its_numbers_and_a_reversed_one_is_said_so() -> None:
    """DeepSeek-Math-7B on GSM8K: IT 71.57 (Table 4) above MFT 70.20 (Table 1), ClozeMath 74.22 above both. Here MFT is
    right on 100 more of 400 problems than IT in each of 3 seeds: -25 points, every replicate below 0."""
    assert paper_pairs({"mft", "it", "clozemath", "it (lr=0.001)"}, REPLICATION_METHODS) == [
        ("it", "mft"), ("clozemath", "it"), ("clozemath", "mft")]
    it = {s: right_on(100, PROBLEMS) for s in "012"}
    mft = {s: right_on(200, PROBLEMS) for s in "012"}
    difference = seeds_difference(it, mft)
    reversed_one = Comparison(("gsm8k", "greedy"), "it", "mft", -25.0, difference, problems_difference(it, mft),
                              trained_seeds=3)
    assert difference is not None and verdict(reversed_one) == "reversed"
    text = orderings_paragraph([reversed_one], str.upper, "GSM8K greedy")
    assert text.splitlines()[1] == (f"- Reversed, 1: IT > MFT (-25.00 [{difference.low:+.2f}, {difference.high:+.2f}], "
                                    "provisional: 3 seeds).")
    assert "3 and 3 runs × 400 problems" in text.splitlines()[0]


def test_orderings_of_unequal_seed_counts_each_name_their_own() -> None:
    """Table 4's ablations ran 3 seeds beside the main grid's 5: each comparison says what it pools, not the first's
    count for all. IT right on 120 of 400 and MFT on 100 in every seed: +5 points."""
    it = {s: right_on(120, PROBLEMS) for s in "01234"}
    mft = {s: right_on(100, PROBLEMS) for s in "01234"}
    five = Comparison(("gsm8k", "greedy"), "it", "mft", 5.0, seeds_difference(it, mft), None, trained_seeds=5)
    three_seeds = {s: it[s] for s in "012"}
    three = Comparison(("gsm8k", "greedy"), "it", "mft", 5.0, seeds_difference(three_seeds, mft), None,
                       trained_seeds=3)
    text = orderings_paragraph([five, three], str.upper, "GSM8K greedy")
    heading, holds = text.splitlines()
    assert "runs ×" not in heading and "each with its runs and problems" in heading
    bounds = [f"[{c.seeds.low:+.2f}, {c.seeds.high:+.2f}]" for c in (five, three) if c.seeds is not None]
    assert holds == (f"- Hold, 2: IT > MFT (+5.00 {bounds[0]}, 5 and 5 runs × 400 problems); "
                     f"IT > MFT (+5.00 {bounds[1]}, 3 and 5 runs × 400 problems, provisional: 3 seeds).")


def test_table_4s_ablations_reported_beside_the_main_grids_runs(
    store: TrackingConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second grid of W/o Text infilling only (right on [0, 130 + offset)), reported with the main one: it pairs
    with the main grid's IT (+10 problems a seed, +2.50) and ClozeMath (-30, the paper's order: ClozeMath first,
    +7.50); a grid holding a trial the other has too is refused."""
    monkeypatch.setitem(RIGHT, "it_prefixlm", 130)
    ablations = TrackingConfig(uri=store.uri, experiment="ablations")
    parent = tracking.start_run(ablations, "ablations", tags={"role": "grid"}).run_id
    for seed in OFFSETS:
        log_trial(ablations, parent, "it_prefixlm", seed, tmp_path / "ablations")
    argv = ["report", "--experiment", "replication", "--experiment", "ablations", "--tracking-uri", store.uri]
    assert main([*argv, "--out", str(tmp_path / "both")]) == 0
    out = capsys.readouterr().out
    assert out.count("grid run ") == 2 and (tmp_path / "both" / "tables.md").is_file()
    assert cells(out, "GSM8K greedy", "W/o Text infilling", "IT")[0] == "+2.50"
    assert cells(out, "GSM8K greedy", "ClozeMath", "W/o Text infilling")[0] == "+7.50"
    assert cells(out, "W/o Text infilling") == [f"{(130 + 16 / 3) / 4:.2f} ± {statistics.stdev([0, 1, 3]):.2f} (3)"]

    duplicate = TrackingConfig(uri=store.uri, experiment="duplicate")
    parent = tracking.start_run(duplicate, "duplicate", tags={"role": "grid"}).run_id
    log_trial(duplicate, parent, "it", "0", tmp_path / "duplicate")
    assert main(["report", "--experiment", "replication", "--experiment", "duplicate", "--tracking-uri", store.uri,
                 "--out", str(tmp_path / "dup")]) == 2
    assert ("experiments 'replication' and 'duplicate' both hold it seed 0 of smollm2-135m on gsm8k: report them "
            "apart") in capsys.readouterr().err


def test_a_seed_added_by_a_grid_of_its_own_is_reported_with_the_first_grid(tmp_path: Path, capsys) -> None:
    """Seeds 0-1 in one grid run, seed 2 later in another of the same experiment: `--parent` twice reports them as
    one (three seeds), the latest alone has one; a grid run holding a seed the other has too, or a run that is no
    grid of the experiment, is a one-line error."""
    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="replication")
    first = tracking.start_run(config, "replication", tags={"role": "grid"}).run_id
    for seed in ("0", "1"):
        log_trial(config, first, "clozemath", seed, tmp_path / "first")
    later = tracking.start_run(config, "replication", tags={"role": "grid"}).run_id
    log_trial(config, later, "clozemath", "2", tmp_path / "later")
    argv = ["report", "--experiment", "replication", "--tracking-uri", config.uri, "--decoding", "greedy"]

    assert main([*argv, "--out", str(tmp_path / "latest")]) == 0
    assert cells(capsys.readouterr().out, "ClozeMath") == [f"{100 * (RIGHT['clozemath'] + 12) / PROBLEMS:.2f} (1)"]

    assert main([*argv, "--parent", first, "--parent", later, "--parent", first, "--out", str(tmp_path / "both")]) == 0
    out = capsys.readouterr().out
    assert out.count("grid run ") == 2  # a grid run named twice is read once
    clozemath = seed_accuracies("clozemath")
    assert cells(out, "ClozeMath") == [f"{statistics.fmean(clozemath):.2f} ± {statistics.stdev(clozemath):.2f} (3)"]

    again = tracking.start_run(config, "replication", tags={"role": "grid"}).run_id
    log_trial(config, again, "clozemath", "1", tmp_path / "again")
    assert main([*argv, "--parent", first, "--parent", again, "--out", str(tmp_path / "dup")]) == 2
    assert (f"grid runs {first} and {again} both hold clozemath seed 1 of smollm2-135m on gsm8k: report them apart"
            in capsys.readouterr().err)
    trial = tracking.find_runs(config, {"role": "trial"})[0].info.run_id
    assert main([*argv, "--parent", trial, "--out", str(tmp_path / "trial")]) == 2
    assert f"--parent {trial}: not a grid run of experiment 'replication'" in capsys.readouterr().err
    assert main([*argv, "--parent", "f" * 32, "--out", str(tmp_path / "none")]) == 2
    assert f"--parent {'f' * 32}: no such run" in capsys.readouterr().err


def test_a_report_from_the_exported_predictions_alone(
    store: TrackingConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A committed export is enough to report a grid whose tracking store is gone: the trials named as the export
    names them, their accuracies computed from the predictions; no store is opened or created."""
    argv = ["report", "--experiment", "replication", "--tracking-uri", store.uri]
    assert main([*argv, "--out", str(tmp_path / "stored"), "--export-predictions", "compact"]) == 0
    stored = capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    assert main(["report", "--predictions", str(tmp_path / "stored" / "predictions.jsonl.gz"), "--out", "alone"]) == 0
    alone = capsys.readouterr().out
    assert not (tmp_path / "mlruns.db").exists()
    for method in ("Base", "IT", "MFT", "ClozeMath"):
        assert cells(alone, method) == cells(stored, method)
    assert cells(alone, "GSM8K greedy", "ClozeMath", "IT") == cells(stored, "GSM8K greedy", "ClozeMath", "IT")
    results_table = alone[alone.index("**Results"):alone.index("**Comparisons")]
    assert "W/o Equation masking" not in results_table  # it logged no predictions
    assert (tmp_path / "alone" / "summary.md").read_text().startswith("**The paper's orderings on GSM8K greedy")
    assert main(["report", "--out", "none"]) == 2
    assert "name an --experiment" in capsys.readouterr().err


def test_stored_accuracies_are_rejudged_from_the_predictions_by_todays_rules(tmp_path: Path, capsys) -> None:
    """A trial evaluated before the cut rule logged 2 of 4 right, one of them a cut generation's last number; its
    predictions file has no `lenient` field. The report re-judges it: 1 of 4 (25%), lenient 50%."""
    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="old")
    parent = tracking.start_run(config, "old", tags={"role": "grid"}).run_id
    tags = {"model": "smollm2-135m", "method": "it", "train_set": "gsm8k", "seed": "0", "role": "trial"}
    run = tracking.start_run(config, "old/it,0", parent, tags)
    rows = [{"id": "a", "dataset": "gsm8k", "decoding": "greedy", "generation": "#### 7", "gold": "7", "correct": True,
             "extracted": "7", "rule": "strict", "finish_reason": "eos"},
            {"id": "b", "dataset": "gsm8k", "decoding": "greedy", "generation": "12 12 12", "gold": "12",
             "correct": True, "extracted": "12", "rule": "flexible", "finish_reason": "length"},
            *({"id": i, "dataset": "gsm8k", "decoding": "greedy", "generation": "#### 1", "gold": "2", "correct": False,
               "extracted": "1", "rule": "strict", "finish_reason": "eos"} for i in "cd")]
    predictions = tmp_path / "eval" / "predictions"
    predictions.mkdir(parents=True)
    (predictions / "gsm8k.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run.log_artifacts(predictions.parent, "eval")
    run.log_metrics(10, {"eval/gsm8k/greedy/accuracy": 0.5, "eval/gsm8k/greedy/correct": 2,
                         "eval/gsm8k/greedy/total": 4})
    run.end()
    assert main(["report", "--experiment", "old", "--tracking-uri", config.uri, "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert cells(out, "IT") == ["25.00 (1)"]
    grading = out.split("**Grading")[1]
    assert cells(grading, "GSM8K greedy", "IT")[:4] == ["25.00", "25.00", "25.00", "50.00"]


@pytest.mark.parametrize("paired", [True, False])
def test_seeds_are_paired_only_where_the_grid_declares_it(tmp_path: Path, capsys, paired: bool) -> None:
    """W/o Text infilling and IT at seeds that move them alike (right on 100/140/180 and 110/150/190 of 400): +2.50 in
    every pair. Declared paired (`train.paired_seeds`), the pairs agree and the difference is real; not declared,
    the seeds' spread (10 points a side) hides it."""
    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="pairs")
    parent = tracking.start_run(config, "pairs", tags={"role": "grid"}).run_id
    for method, extra in (("it", 0), ("it_prefixlm", 10)):
        for seed in "012":
            tags = {"model": "smollm2-135m", "method": method, "train_set": "gsm8k", "seed": seed, "role": "trial"}
            run = tracking.start_run(config, f"pairs/{method},{seed}", parent, tags)
            run.log_params({"train.paired_seeds": paired})
            correctness = right_on(100 + 40 * int(seed) + extra, PROBLEMS)
            folder = tmp_path / method / seed / "predictions"
            folder.mkdir(parents=True)
            (folder / "gsm8k.jsonl").write_text("".join(
                json.dumps({"id": i, "dataset": "gsm8k", "decoding": "greedy", "generation": "", "gold": "1",
                            "correct": right}) + "\n" for i, right in correctness.items()))
            run.log_artifacts(folder.parent, "eval")
            run.log_metrics(1, {"eval/gsm8k/greedy/accuracy": sum(correctness.values()) / PROBLEMS})
            run.end()
    assert main(["report", "--experiment", "pairs", "--tracking-uri", config.uri, "--out", str(tmp_path / "r")]) == 0
    delta, over_seeds, judged, _, _ = cells(capsys.readouterr().out, "GSM8K greedy", "W/o Text infilling", "IT")
    assert delta == "+2.50" and over_seeds.endswith(" (paired seeds)") == paired
    assert judged == ("excludes 0" if paired else "holds 0") + ", provisional: 3 seeds"


def test_reruns_of_a_seed_give_the_noise_floor_and_stay_out_of_the_other_tables(tmp_path: Path, capsys) -> None:
    """IT seeds 0 and 1 (right on 120 and 124 of 400), and seed 0 run again (`train.rerun: 1`) right on 116 of the
    same problems plus 6 others (problems 0-115 and 200-205: 122 right), 0.50 points from its first run; 10 answers
    of 400 differ (116-119 and 200-205: 2.5%). The results table holds seeds 0 and 1 only; the rerun joins the trials' metrics."""
    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="reruns")
    parent = tracking.start_run(config, "reruns", tags={"role": "grid"}).run_id
    runs = {("0", 0): right_on(120, PROBLEMS), ("1", 0): right_on(124, PROBLEMS),
            ("0", 1): {i: right or ("p200" <= i <= "p205") for i, right in right_on(116, PROBLEMS).items()}}
    for (seed, rerun), correctness in runs.items():
        tags = {"model": "smollm2-135m", "method": "it", "train_set": "gsm8k", "seed": seed, "role": "trial",
                "trial": f"reruns/method=it,seed={seed},rerun={rerun}"}
        run = tracking.start_run(config, tags["trial"], parent, tags)
        run.log_params({"train.rerun": rerun})
        folder = tmp_path / seed / str(rerun) / "predictions"
        folder.mkdir(parents=True)
        (folder / "gsm8k.jsonl").write_text("".join(
            json.dumps({"id": i, "dataset": "gsm8k", "decoding": "greedy", "generation": "", "gold": "1",
                        "correct": right}) + "\n" for i, right in correctness.items()))
        run.log_artifacts(folder.parent, "eval")
        run.log_metrics(1, {"eval/gsm8k/greedy/accuracy": sum(correctness.values()) / PROBLEMS})
        run.end()
    out_folder = tmp_path / "r"
    assert main(["report", "--experiment", "reruns", "--tracking-uri", config.uri, "--out", str(out_folder)]) == 0
    out = capsys.readouterr().out
    assert cells(out.split("**Results")[1], "IT") == [f"30.50 ± {statistics.stdev([30, 31]):.2f} (2)"]
    floor = out.split("**Run-to-run noise floor: SmolLM2-135M-Instruct trained on GSM8K")[1]
    assert cells(floor, "GSM8K greedy", "IT") == ["1", "0.50", "0.50", "2.5"]
    assert len(json.loads((out_folder / "trials.json").read_text())) == 3


def test_grid_variants_sit_at_their_methods_place_ordered_by_their_numbers() -> None:
    """A rate sweep's methods: IT's rates 5e-05 < 0.0001 < 0.0003 < 0.001 in that order (not as strings, where
    '5e-05' sorts last), each method's variants at its place in the preferred order, unknown names after."""
    from clozemath.report.names import ordered

    names = ["mft (lr=0.001)", "it (lr=5e-05)", "zeta", "it (lr=0.001)", "base (lr=5e-05)", "it (lr=0.0001)",
             "mft (lr=5e-05)", "it (lr=0.0003)", "it"]
    assert ordered(names, ["base", "it", "mft"]) == [
        "base (lr=5e-05)", "it", "it (lr=5e-05)", "it (lr=0.0001)", "it (lr=0.0003)", "it (lr=0.001)",
        "mft (lr=5e-05)", "mft (lr=0.001)", "zeta"]
