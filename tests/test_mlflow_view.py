"""The MLflow UI as a researcher opens it: a model-training experiment whose description points at the grid's report and
at a saved view of its trials; trial runs named by what varies, tagged with what they are compared by, with readable
params and a headline accuracy in percent; the grid run holding the report as artifacts; `clozemath report` on a store
whose artifacts are gone naming the `--predictions` export. Read back through MLflow's client from one ablation grid
on CPU (slow), and the naming rules on their own (fast). docs/mlflow_ui.md shows the same store in a browser."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Run

from clozemath import tracking
from clozemath.config import ExperimentConfig, GridConfig, TrackingConfig
from clozemath.plan import load_plan
from clozemath.records import readable_params, short_number, trial_run_names
from clozemath.report.names import METHOD_NAMES
from clozemath_cli import main
from conftest import run_command

ROOT = Path(__file__).resolve().parents[1]
GRID = "configs/grids/smoke.yaml"
ABLATION = ["axes.model=[tiny-llama]", "axes.method=[base,clozemath,clozemath_causal]", "axes.dataset=[gsm8k]"]
"""ClozeMath beside its ablation without PrefixLM and the base model: 3 trials, 2 of them trained (4 steps each)."""


# --------------------------------------------------------------------------------------------------------------
# The rules on their own


def test_a_trial_is_named_by_its_method_what_else_varies_and_its_seed() -> None:
    points = [{"model": "m", "method": method, "train.lr": lr, "train.seed": seed}
              for method in ("it", "clozemath") for lr in (3e-4, 1e-3) for seed in (0, 1)]
    names = trial_run_names(points, "grid")
    assert names[:4] == ["it · lr 3e-4 · seed 0", "it · lr 3e-4 · seed 1", "it · lr 1e-3 · seed 0",
                         "it · lr 1e-3 · seed 1"]
    assert names[4] == "clozemath · lr 3e-4 · seed 0"  # the model takes one value: left out
    two_models = trial_run_names([{"model": "a", "method": "it"}, {"model": "b", "method": "it"}], "grid")
    assert two_models == ["it · a", "it · b"]
    assert trial_run_names([{}], "quickstart") == ["quickstart"]  # an experiment: a grid of one, without axes


def test_rates_read_as_a_person_writes_them() -> None:
    assert [short_number(v) for v in (5e-5, 3.0e-4, 1e-3, 0.01, 0.5, 2.0)] == ["5e-5", "3e-4", "1e-3", "0.01", "0.5",
                                                                                  "2"]


def test_params_hold_no_python_reprs() -> None:
    plan = load_plan(ROOT / GRID, ABLATION)
    params = readable_params(plan.experiments[-1])
    assert params["eval.sets"] == "gsm8k, gsm_symbolic, gsm_p1, gsm_p2"
    assert params["eval.sets.gsm8k.decodings"] == "beam, cot" and params["eval.sets.gsm_p1.limit"] == "2"
    assert params["eval.decodings"] == "beam, cot" and params["method.objectives"] == "lm, cloze"
    assert params["train.lr"] == "0.01" and params["train.paired_seeds"] in ("True", "False")  # scalars as before
    reprs = {key: value for key, value in params.items() if re.search(r"[\[{]'|'[\]}]", value)}
    assert not reprs


# --------------------------------------------------------------------------------------------------------------
# One ablation grid, read back through MLflow's client (slow)


@pytest.fixture(scope="module")
def ablation_grid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], list[ExperimentConfig]]:
    """`clozemath run` of the ablation grid in a process of its own (its own Ray): its folder (`runs/`, `mlruns.db`),
    its console, and its trials' configs."""
    folder = tmp_path_factory.mktemp("ablation")
    store = [f"train.output_dir={folder / 'runs'}", f"tracking.uri=sqlite:///{folder / 'mlruns.db'}"]
    code, console = run_command(["run", GRID, *ABLATION, *store], 600, folder / "runs")
    assert code == 0, console[-4000:]
    plan = load_plan(ROOT / GRID, [*ABLATION, *store])
    return folder, console.splitlines(), plan.experiments


def _store(folder: Path) -> TrackingConfig:
    return TrackingConfig(uri=f"sqlite:///{folder / 'mlruns.db'}", experiment="smoke-grid")


def _trials(folder: Path) -> dict[str, Run]:
    return {run.data.tags["trial"]: run for run in tracking.find_runs(_store(folder), {"role": "trial"})}


@pytest.mark.slow
def test_trials_are_named_tagged_and_measured_for_the_runs_table(ablation_grid) -> None:
    folder, _, experiments = ablation_grid
    runs = _trials(folder)
    assert sorted(runs) == sorted(e.name for e in experiments)
    assert sorted(run.info.run_name for run in runs.values()) == [
        "base · seed 0", "clozemath · seed 0", "clozemath_causal · seed 0"]
    for experiment in experiments:
        run = runs[experiment.name]
        tags, metrics, params = run.data.tags, run.data.metrics, run.data.params
        method = experiment.method.name
        assert run.info.run_name.startswith(f"{method} · ")
        assert {key: tags[key] for key in ("method", "ablation", "seed", "model", "train_set")} == {
            "method": method, "ablation": METHOD_NAMES[method], "seed": "0", "model": "tiny-llama",
            "train_set": "gsm8k"}
        assert tags.get("lr") == (None if method == "base" else short_number(experiment.train.lr))
        headline = "gsm8k/greedy" if method == "base" else "gsm8k/beam"
        assert tags["accuracy_of"] == headline
        assert metrics["accuracy_pct"] == pytest.approx(100 * metrics[f"eval/{headline}/accuracy"])
        assert params == {**params, **readable_params(experiment)}
        assert not [value for value in params.values() if re.search(r"[\[{]'|'[\]}]", value)]
    assert {runs[e.name].data.tags["ablation"] for e in experiments} == {"Base", "ClozeMath", "W/o PrefixLM"}


@pytest.mark.slow
def test_the_grid_run_holds_the_report_and_the_experiment_points_at_it(ablation_grid) -> None:
    folder, lines, _ = ablation_grid
    client = MlflowClient(tracking_uri=_store(folder).uri)
    experiment = client.get_experiment_by_name("smoke-grid")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # a model-training experiment
    (grid_run,) = tracking.find_runs(_store(folder), {"role": "grid"})
    artifacts = {a.path for a in client.list_artifacts(grid_run.info.run_id, "report")}
    assert {f"report/{name}" for name in ("tables.md", "summary.md", "trials.json", "accuracy_vs_steps.png")} <= artifacts
    report = folder / "runs" / "smoke-grid" / "report"
    logged = Path(client.download_artifacts(grid_run.info.run_id, "report/tables.md", str(folder)))
    assert logged.read_text() == (report / "tables.md").read_text()
    assert "| ClozeMath |" in logged.read_text() and "| W/o PrefixLM |" in logged.read_text()
    trials = json.loads((report / "trials.json").read_text())
    assert {trial["run_name"] for trial in trials} == {run.info.run_name for run in _trials(folder).values()}

    note = experiment.tags["mlflow.note.content"]
    eid, run_id = experiment.experiment_id, grid_run.info.run_id
    assert f"(#/experiments/{eid}/runs/{run_id}/artifacts/report/tables.md?workflowType=machine_learning)" in note
    view = f"#/experiments/{eid}/runs?workflowType=machine_learning&viewStateShareKey=clozemath-smoke-grid"
    assert f"({view})" in note
    assert f"[smoke-grid] report: {report} (also the grid run's artifacts, report/)" in lines
    (browse,) = [line for line in lines if line.startswith("browse:")]
    assert browse.endswith(f", then open http://127.0.0.1:5000/{view}")

    saved = json.loads(experiment.tags["mlflow.sharedViewState.clozemath-smoke-grid"])
    state = json.loads(saved["state"])
    assert saved["name"] == "clozemath: smoke-grid trials"
    assert state["selectedColumns"][:3] == ["metrics.`accuracy_pct`", "tags.`ablation`", "tags.`method`"]
    shown = client.search_runs([eid], filter_string=state["searchFilter"])  # the view's filter: the trials alone
    assert sorted(run.info.run_id for run in shown) == sorted(run.info.run_id for run in _trials(folder).values())


@pytest.mark.slow
def test_report_without_the_artifacts_names_the_predictions_export(
    ablation_grid, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, _, _ = ablation_grid
    uri = _store(folder).uri
    assert main(["report", "--experiment", "smoke-grid", "--tracking-uri", uri, "--out", str(tmp_path / "full"),
                 "--export-predictions", "compact"]) == 0
    assert "note:" not in capsys.readouterr().out
    export = tmp_path / "full" / "predictions.jsonl.gz"
    artifacts, away = folder / "mlartifacts", folder / "mlartifacts-away"
    artifacts.rename(away)  # the store without its artifacts, as a committed store comes
    try:
        assert main(["report", "--experiment", "smoke-grid", "--tracking-uri", uri, "--out", str(tmp_path / "a")]) == 0
        out = capsys.readouterr().out
        assert (f"note: 3 trials have no per-problem predictions among their MLflow artifacts ({artifacts}/"
                in out), out[:2000]
        assert "give them: --predictions FILE" in out
        assert main(["report", "--experiment", "smoke-grid", "--tracking-uri", uri, "--out", str(tmp_path / "b"),
                     "--predictions", str(export)]) == 0
        assert "note:" not in capsys.readouterr().out
    finally:
        away.rename(artifacts)
    assert (tmp_path / "b" / "tables.md").read_text() == (tmp_path / "full" / "tables.md").read_text()


def test_an_experiment_made_elsewhere_becomes_a_model_training_one_and_keeps_a_description_written_by_hand(
    tmp_path: Path
) -> None:
    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="mine")
    client = tracking.client(config.uri)
    made = client.create_experiment("mine")  # by hand, or by an older clozemath: no kind
    client.set_experiment_tag(made, "mlflow.note.content", "My notes on these runs.")
    grid_run = tracking.start_run(config, "g", tags={"role": "grid"})
    assert client.get_experiment(made).tags["mlflow.experimentKind"] == "custom_model_development"
    tracking.describe_experiment(config, grid_run, "g", ["tables.md"], tracking.trials_view(config, "g"))
    assert client.get_experiment(made).tags["mlflow.note.content"] == "My notes on these runs."
    client.delete_experiment_tag(made, "mlflow.note.content")
    tracking.describe_experiment(config, grid_run, "g", ["tables.md"], "#/view")
    note = client.get_experiment(made).tags["mlflow.note.content"]
    assert note.startswith("**clozemath grid `g`**: [its trials side by side](#/view)")
    tracking.describe_experiment(config, grid_run, "g2", ["tables.md"], "#/view2")  # ours: written over
    assert client.get_experiment(made).tags["mlflow.note.content"].startswith("**clozemath grid `g2`**")
