"""`clozemath report` on runs logged here (no Ray): means over seeds, GSM-Symbolic pooled, best cells in bold, LaTeX,
the accuracy-vs-steps plot, the latest grid run chosen."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from clozemath import tracking
from clozemath_cli import main
from clozemath.config import TrackingConfig
from clozemath.errors import ClozeMathError
from clozemath.report import accuracy_curves, grid_runs, paper_tables, to_markdown
from clozemath.report.history import StoreHistories

SEEDS = ("0", "1")
ABLATIONS = ("it_prefixlm", "clozemath_causal", "it", "random_span")
STEPS = {"mft": 1400, "clozemath": 8886, "it": 1400, "it_prefixlm": 1400, "clozemath_causal": 8886,
         "random_span": 8886}


def accuracy(model: str, method: str, train_set: str, seed: str, eval_set: str, decoding: str = "beam") -> float:
    """Made-up accuracies, distinct enough that every mean and every best cell is unambiguous."""
    base = {"deepseek-math-7b": 0.6, "llama-3.2-1b": 0.2}[model]
    bonus = {"base": 0.0, "mft": 0.05, "clozemath": 0.08, "it": 0.03, "it_prefixlm": 0.04, "clozemath_causal": 0.06,
             "random_span": 0.02}[method]
    shift = {"gsm8k": 0.0, "math": -0.1, "gsm_symbolic": -0.05, "gsm_p1": -0.1, "gsm_p2": -0.15}[eval_set]
    noise = (0.01 if decoding == "cot" else 0.0) + 0.002 * int(seed) + (train_set == "math") * 0.001
    return round(base + bonus + shift + noise, 4)


TOTALS = {"gsm8k": 100, "math": 50, "gsm_symbolic": 40, "gsm_p1": 40, "gsm_p2": 20}


def log_trial(config: TrackingConfig, parent: str, model: str, method: str, train_set: str, seed: str) -> None:
    tags = {"model": model, "method": method, "train_set": train_set, "seed": seed, "role": "trial"}
    run = tracking.start_run(config, f"g/{model},{method},{train_set},{seed}", parent, tags)
    sets = [train_set, "gsm_symbolic", "gsm_p1", "gsm_p2"] if method in ("mft", "clozemath") else [train_set]
    values: dict[str, float] = {}
    for eval_set in sets:
        decodings = ["beam", "cot"] if eval_set == "gsm8k" and method in ("mft", "clozemath") else ["beam"]
        decodings = ["greedy"] if method == "base" else decodings  # as lm-evaluation-harness runs base models
        for decoding in decodings:
            value = accuracy(model, method, train_set, seed, eval_set, decoding)
            key = f"eval/{eval_set}/{decoding}"
            total = TOTALS[eval_set]
            values |= {f"{key}/accuracy": value, f"{key}/correct": round(value * total), f"{key}/total": total}
    if method != "base":
        run.log_metrics(10, {"curve/gsm8k/beam/accuracy": 0.1 * int(seed)})
        steps = STEPS[method]
        run.log_params({"train.planned_steps": steps, "train.planned_tokens": 1000 * steps})
        if seed == "1":  # what training did is recorded from seed 1 on (seed 0: a run from before that record)
            run.log_params({"train.trained_steps": steps, "train.trained_tokens": 1000 * steps - 7})
    run.log_metrics(20, values)
    run.end()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> TrackingConfig:
    folder = tmp_path_factory.mktemp("report")
    config = TrackingConfig(uri=f"sqlite:///{folder / 'mlruns.db'}", experiment="paper")
    older = tracking.start_run(config, "older", tags={"role": "grid"}).run_id
    log_trial(config, older, "llama-3.2-1b", "clozemath", "gsm8k", "0")
    parent = tracking.start_run(config, "paper", tags={"role": "grid"}).run_id
    for model in ("deepseek-math-7b", "llama-3.2-1b"):
        for train_set in ("gsm8k", "math"):
            log_trial(config, parent, model, "base", train_set, "0")
            for method in ("mft", "clozemath"):
                for seed in SEEDS:
                    log_trial(config, parent, model, method, train_set, seed)
    for method in ABLATIONS:
        log_trial(config, parent, "deepseek-math-7b", method, "gsm8k", "0")
    return config


def mean(model: str, method: str, train_set: str, eval_set: str, decoding: str = "beam", seeds=SEEDS) -> str:
    """The cell of the paper's tables: "mean ± sample std (seeds)" in percent, "value (1)" for one seed."""
    values = [100 * accuracy(model, method, train_set, s, eval_set, decoding) for s in seeds]
    if len(values) == 1:
        return f"{values[0]:.2f} (1)"
    return f"{sum(values) / len(values):.2f} ± {statistics.stdev(values):.2f} ({len(values)})"


def row(text: str, *labels: str) -> list[str]:
    """The value cells of the markdown row whose label cells are `labels`."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[: len(labels)] == list(labels):
            return cells[len(labels):]
    raise AssertionError(f"no row {labels} in\n{text}")


def test_tables_hold_the_means_over_seeds_with_the_best_in_bold(store: TrackingConfig, tmp_path: Path, capsys) -> None:
    assert main(["report", "--experiment", "paper", "--tracking-uri", store.uri, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "grid run" in out and "(paper): 24 trials" in out  # the latest grid run, not the older one

    table1 = out.split("**Table 2")[0]
    assert "| Training set | Method | DeepSeek-Math | Llama-3.2-1B |" in table1
    assert row(table1, "GSM8K", "Base") == [mean("deepseek-math-7b", "base", "gsm8k", "gsm8k", seeds=("0",)),
                                             mean("llama-3.2-1b", "base", "gsm8k", "gsm8k", seeds=("0",))]
    assert row(table1, "GSM8K", "ClozeMath") == [f"**{mean(m, 'clozemath', 'gsm8k', 'gsm8k')}**"
                                                  for m in ("deepseek-math-7b", "llama-3.2-1b")]
    assert row(table1, "MATH", "MFT") == [mean(m, "mft", "math", "math") for m in ("deepseek-math-7b", "llama-3.2-1b")]

    table2 = out.split("**Table 2")[1].split("**Table 3")[0]
    assert row(table2, "Llama-3.2-1B") == [mean("llama-3.2-1b", "mft", "gsm8k", "gsm8k", "cot"),
                                           f"**{mean('llama-3.2-1b', 'clozemath', 'gsm8k', 'gsm8k', 'cot')}**"]

    table3 = out.split("**Table 3")[1].split("**Table 4")[0]
    assert "Overall pools a run's answers of GSM-Sym 40 + GSM-P1 40 + GSM-P2 20 problems)" in table3.splitlines()[0]
    models = ("deepseek-math-7b", "llama-3.2-1b")
    assert row(table3, "MATH", "GSM-P1", "MFT") == [mean(m, "mft", "math", "gsm_p1") for m in models]
    pooled = []
    for seed in SEEDS:  # Overall: correct answers of the three sets over their problems, then the mean over seeds
        correct = sum(round(accuracy("deepseek-math-7b", "clozemath", "gsm8k", seed, s) * TOTALS[s])
                      for s in ("gsm_symbolic", "gsm_p1", "gsm_p2"))
        pooled.append(correct / 100)
    assert row(table3, "GSM8K", "Overall", "ClozeMath")[0] == \
        f"**{100 * sum(pooled) / 2:.2f} ± {100 * statistics.stdev(pooled):.2f} (2)**"

    table4 = out.split("**Table 4")[1].split("**Compute")[0]
    assert "| Method | DeepSeek-Math |" in table4  # only the model with ablations
    assert row(table4, "ClozeMath") == [f"**{mean('deepseek-math-7b', 'clozemath', 'gsm8k', 'gsm8k')}**"]
    rows = [line.split("|")[1].strip() for line in table4.splitlines() if line.startswith("| ")][2:]
    assert rows == ["ClozeMath", "W/o Text infilling", "W/o PrefixLM", "W/o Text-infilling & W/o PrefixLM",
                    "W/o Equation masking"]  # the paper's five rows, in its order
    for method, name in zip(ABLATIONS, rows[1:]):
        assert row(table4, name) == [mean("deepseek-math-7b", method, "gsm8k", "gsm8k", seeds=("0",))]
    compute = out.split("**Compute")[1]
    assert "| Steps | Trained tokens | Planned tokens |" in compute
    assert row(compute, "GSM8K", "DeepSeek-Math", "W/o Equation masking", "0") == ["8,886", "–", "8,886,000"]
    assert row(compute, "MATH", "Llama-3.2-1B", "MFT", "1") == ["1,400", "1,399,993", "1,400,000"]
    # outside Table 4, `it` is the IT baseline, not the ablation's name
    assert row(compute, "GSM8K", "DeepSeek-Math", "IT", "0") and "W/o Text-infilling" not in compute + table3
    assert "| Base |" not in compute  # nothing trained
    assert (tmp_path / "tables.md").read_text().strip() in out
    assert (tmp_path / "accuracy_vs_steps.png").read_bytes()[:4] == b"\x89PNG"


def test_latex_bolds_with_textbf(store: TrackingConfig, tmp_path: Path, capsys) -> None:
    argv = ["report", "--experiment", "paper", "--tracking-uri", store.uri, "--out", str(tmp_path), "--latex"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("% Table ") == 4 and r"W/o Text infilling & " in out  # a label, then a value
    assert "Training set & Method" not in out and r"\textbf{Training set} & \textbf{Method}" in out
    assert r"W/o Text-infilling \& W/o PrefixLM & " in out
    best = mean("deepseek-math-7b", "clozemath", "gsm8k", "gsm8k").replace("±", r"$\pm$")
    assert f"GSM8K & ClozeMath & \\textbf{{{best}}} & " in out
    assert (tmp_path / "tables.tex").is_file()


def test_a_chosen_parent_and_the_accuracy_curves(store: TrackingConfig) -> None:
    older = tracking.find_runs(store, {"role": "grid"})[-1]
    parent, results = grid_runs(store.uri, "paper", older.info.run_id)
    assert parent.info.run_name == "older" and [(r.model, r.method) for r in results] == [("llama-3.2-1b", "clozemath")]
    (table1, *_) = paper_tables(results)
    value = mean("llama-3.2-1b", "clozemath", "gsm8k", "gsm8k", seeds=("0",))
    assert to_markdown(table1).splitlines()[-1] == f"| GSM8K | ClozeMath | **{value}** |"


def test_figure_3_curves_hold_only_the_points_on_the_training_time_subset(store: TrackingConfig) -> None:
    """Each trial logs a subset point (`curve/...`) at step 10 and its full-set accuracy (`eval/...`) at step 20."""
    _, results = grid_runs(store.uri, "paper")
    curves = accuracy_curves(StoreHistories(store.uri), results, "beam")
    (point,) = curves["llama-3.2-1b"]["clozemath"]  # seeds 0 and 1 at 0% and 10%
    assert (point.step, point.mean, point.low, point.high, point.seeds) == (10, pytest.approx(5), 0, pytest.approx(10), 2)
    assert set(curves["deepseek-math-7b"]) == {"mft", "clozemath", *ABLATIONS}
    # The runs logged their curve in beam only: tables in greedy still plot it (the replication's curve was greedy,
    # its tables beam, and the figure came out empty).
    assert accuracy_curves(StoreHistories(store.uri), results, "greedy") == curves


def test_figure_3_pairs_each_seeds_kth_evaluation_and_bands_the_seeds(tmp_path: Path) -> None:
    """Seeds whose matched budgets differ by a step (at `every_share: 0.5`, 50 and 100 of 100 steps, 51 and 101 of
    101): the k-th points pair up, at the mean step, with the seeds' range; a seed with a point more (a run that
    evaluated at 150 too) adds none the others lack."""
    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="curves")
    parent = tracking.start_run(config, "curves", tags={"role": "grid"}).run_id
    curves = {"0": [(50, 0.1), (100, 0.3)], "1": [(51, 0.2), (101, 0.5)], "2": [(50, 0.0), (100, 0.1), (150, 0.9)]}
    for seed, points in curves.items():
        tags = {"model": "m", "method": "it", "train_set": "gsm8k", "seed": seed, "role": "trial"}
        run = tracking.start_run(config, f"curves/{seed}", parent, tags)
        for step, value in points:
            run.log_metrics(step, {"curve/gsm8k/greedy/accuracy": value})
        run.end()
    _, results = grid_runs(config.uri, "curves")
    first, second = accuracy_curves(StoreHistories(config.uri), results, "greedy")["m"]["it"]
    assert (first.step, first.mean, first.low, first.high, first.seeds) == (
        pytest.approx(151 / 3), pytest.approx(10), 0, pytest.approx(20), 3)
    assert (second.step, second.mean, second.low, second.high) == (
        pytest.approx(301 / 3), pytest.approx(30), pytest.approx(10), pytest.approx(50))


def test_an_experiment_without_grid_runs_is_a_one_line_error(store: TrackingConfig) -> None:
    with pytest.raises(ClozeMathError, match="'nothing' not found"):
        grid_runs(store.uri, "nothing")


@pytest.mark.parametrize(("trials", "decoding", "why"), [
    ([("clozemath", "gsm8k")], "beam", "these trials ran ClozeMath alone."),
    ([("clozemath", "math"), ("mft", "math")], "beam", "these trials trained on math."),
    ([("base", "gsm8k"), ("clozemath", "gsm8k")], "greedy",
     "no two of these were (Base: greedy; ClozeMath: beam, cot)."),
    ([("clozemath", "gsm8k")], "greedy", "evaluated on GSM8K test with greedy decoding."),
])
def test_a_summary_with_no_ordering_to_check_says_why(trials: list[tuple[str, str]], decoding: str, why: str,
                                                     tmp_path: Path, capsys) -> None:
    """Reported by greedy decoding, ClozeMath's beams and CoT are no greedy run, and the base model's greedy run is set
    beside a trained method's only at the report's own decoding."""
    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="one")
    parent = tracking.start_run(config, "one", tags={"role": "grid"}).run_id
    for method, train_set in trials:
        log_trial(config, parent, "llama-3.2-1b", method, train_set, "0")
    assert main(["report", "--experiment", "one", "--tracking-uri", config.uri, "--decoding", decoding,
                 "--out", str(tmp_path / "r")]) == 0
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert summary.startswith("**The paper's orderings:** none to check here: ") and why in summary
    assert summary.strip() in capsys.readouterr().out


def test_a_plot_with_no_curve_says_why(tmp_path: Path) -> None:
    from clozemath.report.figure import no_curve_reason, plot_accuracy_vs_steps
    from clozemath.report.runs import TrialResult

    base = TrialResult("a", "m", "base", "gsm8k", "0", {})
    trained = TrialResult("b", "m", "clozemath", "gsm8k", "0", {"eval/gsm8k/beam/accuracy": 0.1})
    assert no_curve_reason([base]) == "no trial was trained on GSM8K"
    assert no_curve_reason([base, trained]).startswith("none of the 1 GSM8K-trained trial evaluated during training")
    said = plot_accuracy_vs_steps({}, tmp_path / "said.png", no_curve_reason([base]))
    silent = plot_accuracy_vs_steps({}, tmp_path / "silent.png", "")
    assert said.read_bytes() != silent.read_bytes()  # the reason is drawn on the panel


def test_the_time_table_gives_each_trial_its_evaluation_and_start_up_and_the_grids_share() -> None:
    from clozemath.report.runs import TrialResult
    from clozemath.report.tables import evaluation_time_table

    base = TrialResult("a", "m", "base", "gsm8k", "0", {"eval/seconds": 60.0, "eval/startup_s": 20.0,
                                                        "eval/decode_s": 40.0}, seconds=80.0)
    trained = TrialResult("b", "m", "it", "gsm8k", "0", {"eval/seconds": 100.0, "eval/startup_s": 30.0,
                                                         "eval/decode_s": 70.0}, steps=10, seconds=320.0)
    older = TrialResult("c", "m", "it", "gsm8k", "1", {"eval/seconds": 40.0}, steps=10, seconds=100.0)
    running = TrialResult("d", "m", "it", "gsm8k", "2", {}, steps=10)
    lines = evaluation_time_table([trained, base, older, running]).splitlines()
    assert "| 80 | 60 | 20 | 40 |" in lines[4] and "| 320 | 100 | 30 | 70 |" in lines[5]
    assert lines[6].endswith("| 100 | 40 | – | – |") and lines[7].endswith("| – | – | – | – |")
    # (60 + 100 + 40) of (80 + 320 + 100) s evaluating, (20 + 30) of them starting
    assert lines[-1] == ("Evaluation: 40% of the trials' run time (3 trials), 10% starting it (2 of 3 trials recorded "
                         "it).")
