"""Evaluation in the training worker (`eval.in_worker`): the model a worker trained, its adapter merged as an
evaluation actor merges it, makes the actor path's predictions and metrics, resumes as it does, and the switch turns
it off (`clozemath.eval.folder`, `ray_jobs.train.EvaluatedHere`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from clozemath.config import ExperimentConfig
from clozemath.eval import folder as eval_folder
from clozemath.eval.folder import evaluate_trained, evaluates_in_worker
from clozemath.eval.predictions import read_predictions
from clozemath.model.load import Loaded, load_model, save_adapter
from clozemath.plan import load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "experiments" / "smoke.yaml"
SETS = "eval.sets=[{dataset: gsm8k, limit: 4}, {dataset: gsm_p1, limit: 3, per_template: 1}]"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _config(*overrides: str) -> ExperimentConfig:
    """The smoke model in float32, 2 sets x 2 decodings, batches of 1 (4 problems to a batch of rows)."""
    return load_config(SMOKE, [SETS, "eval.decodings=[greedy,beam]", "eval.num_beams=2", "eval.max_new_tokens=6",
                               "eval.batch_size=1", *overrides])


def _trained(config: ExperimentConfig, adapter: Path) -> Loaded:
    """A model as a worker holds it when training ends: LoRA and the special-token rows moved off their start (as
    steps would), its adapter saved."""
    trained = load_model(config.model, num_sentinels=2, device="cpu", training=True, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in trained.model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    save_adapter(trained.model, adapter, trained.specials)
    return trained


def _predictions(folder: Path) -> dict[str, list[dict]]:
    return {file.stem: [vars(p) for p in read_predictions(file)] for file in sorted(folder.glob("predictions/*"))}


def test_the_switch_and_the_trial_decide_where_a_trial_is_evaluated():
    assert evaluates_in_worker(load_config(SMOKE))  # one worker, ZeRO-2, its own adapter in its own format
    assert not evaluates_in_worker(load_config(SMOKE, ["eval.in_worker=false"]))
    assert not evaluates_in_worker(load_config(SMOKE, ["train.num_workers=2"]))
    assert not evaluates_in_worker(load_config(SMOKE, ["train.zero_stage=3"]))
    assert not evaluates_in_worker(load_config(SMOKE, ["method=base"]))
    assert not evaluates_in_worker(load_config(SMOKE, ["eval.few_shot=true"]))
    assert not evaluates_in_worker(load_config(SMOKE, ["eval.adapter=/somewhere/else"]))
    assert not evaluates_in_worker(load_config(SMOKE, ["eval.sets=[]"]))


def test_the_worker_makes_the_actors_predictions_and_metrics(ray_session, tmp_path):
    """The same adapter evaluated by Ray Data's actors (a base model loaded afresh, the adapter merged from its
    files) and in the worker that trained it: the same generations, answers and grades; the same metric keys."""
    from ray_jobs.eval_job import evaluate_on_ray

    config = _config()
    adapter = tmp_path / "adapter"
    trained = _trained(config, adapter)
    actors = evaluate_on_ray(config, adapter, tmp_path / "actors")
    worker = evaluate_trained(config, trained, adapter, tmp_path / "worker")

    made = _predictions(tmp_path / "worker")
    assert made == _predictions(tmp_path / "actors") and set(made) == {"gsm8k", "gsm_p1"}
    assert any(p["generation"] for rows in made.values() for p in rows)
    assert set(worker) == set(actors)
    assert {key: value for key, value in worker.items() if "/seconds" not in key and not key.endswith("_s")} == {
        key: value for key, value in actors.items() if "/seconds" not in key and not key.endswith("_s")}
    assert 0 < worker["eval/load_s"] <= worker["eval/startup_s"] < worker["eval/seconds"]


def test_an_evaluation_killed_in_the_worker_is_taken_up_by_the_actors(ray_session, tmp_path, monkeypatch):
    """Killed after its first batch (gsm8k's 4 problems, both decodings: that set finished), the worker's evaluation
    leaves gsm8k's predictions file whole; the trial's evaluation on the actors decodes only gsm_p1's problems and
    ends with the predictions one evaluation in the worker makes."""
    from ray_jobs.eval_job import evaluate_on_ray

    config = _config()
    adapter = tmp_path / "adapter"
    folder = tmp_path / "eval"
    batches = []
    predict_rows = eval_folder.predict_rows

    def killed_at_the_second_batch(model, problems):
        batches.append([problem.dataset for problem in problems])
        if len(batches) == 2:
            raise KeyboardInterrupt
        return predict_rows(model, problems)

    monkeypatch.setattr(eval_folder, "predict_rows", killed_at_the_second_batch)
    with pytest.raises(KeyboardInterrupt):
        evaluate_trained(config, _trained(config, adapter), adapter, folder)
    assert batches == [["gsm8k"] * 4, ["gsm_p1"] * 3]
    finished = folder / "predictions" / "gsm8k.jsonl"
    written = finished.stat().st_mtime_ns
    assert not (folder / "predictions" / "gsm_p1.jsonl").exists()

    values = evaluate_on_ray(config, adapter, folder)
    assert finished.stat().st_mtime_ns == written  # not evaluated, nor written again
    assert values["eval/gsm8k/greedy/total"] == 4 and values["eval/gsm_p1/beam/total"] == 3
    monkeypatch.setattr(eval_folder, "predict_rows", predict_rows)
    evaluate_trained(config, _trained(config, adapter), adapter, tmp_path / "whole")
    assert _predictions(folder) == _predictions(tmp_path / "whole")


def test_an_evaluation_that_finds_every_prediction_made_keeps_the_seconds_of_the_one_that_made_them(tmp_path,
                                                                                                    capsys):
    """The trial's driver evaluates after its worker did: nothing is decoded again, the seconds are the worker's
    evaluation's (the report's time table reads them), and the console says so in one line, with no second bar."""
    config = _config("eval.sets=[{dataset: gsm8k, limit: 2}]", "eval.decodings=[greedy]")
    adapter = tmp_path / "adapter"
    made = evaluate_trained(config, _trained(config, adapter), adapter, tmp_path / "eval")

    def nothing_left(problems):
        raise AssertionError(f"decoded again: {problems}")

    capsys.readouterr()
    again = eval_folder.evaluate_into_folder(config, adapter, tmp_path / "eval", nothing_left)
    printed = "".join(capsys.readouterr())
    assert again == made
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text()) == made
    assert f"[{config.name}] evaluated before, taken up: gsm8k (2 problems, greedy)" in printed
    assert "evaluating" not in printed and "eval gsm8k" not in printed


def test_the_worker_merges_the_weights_an_actor_loads_to_the_bit(tmp_path):
    from clozemath.model.load import load_for_inference, trained_for_inference

    config = _config()
    adapter = tmp_path / "adapter"
    merged = trained_for_inference(config.model, _trained(config, adapter), adapter).model
    loaded = load_for_inference(config.model, adapter, "cpu").model
    assert type(merged) is type(loaded) and not merged.training
    assert merged.config._attn_implementation == loaded.config._attn_implementation
    theirs = loaded.state_dict()
    assert merged.state_dict().keys() == theirs.keys()
    assert all(torch.equal(tensor, theirs[name]) for name, tensor in merged.state_dict().items())


def test_a_run_of_one_worker_is_evaluated_in_it_as_clozemath_eval_evaluates_its_adapter(smoke_samples, tmp_path,
                                                                                         ray_session):
    """The smoke run on one ZeRO-2 worker: its evaluation is the worker's (no actor loads a model; the start-up is
    reading the set and merging the adapter), logged by the trial as ever; `clozemath eval` of its adapter on the actors writes the same
    predictions."""
    from mlflow import MlflowClient

    from clozemath_cli import main
    from tests.conftest import LEARNS, run_smoke

    shutil.copytree(smoke_samples, tmp_path / "runs" / "cache")
    overrides = [*LEARNS, "train.num_workers=1", "eval.sets=[{dataset: gsm8k, limit: 3}]", "eval.max_new_tokens=8"]
    code, lines = run_smoke(tmp_path, *overrides)
    console = "\n".join(lines)
    assert code == 0, console[-3000:]
    assert "[smoke] evaluating in the training worker" in console and "for evaluation with the adapter" not in console
    folder = tmp_path / "runs" / "smoke" / "eval"
    values = json.loads((folder / "metrics.json").read_text())
    assert 0 < values["eval/load_s"] <= values["eval/startup_s"] and values["eval/gsm8k/greedy/total"] == 3
    store = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns.db'}")
    (trial,) = [run for run in store.search_runs([store.get_experiment_by_name("smoke").experiment_id])
                if "eval/startup_s" in run.data.metrics]
    assert trial.data.metrics["eval/startup_s"] == values["eval/startup_s"]

    adapter = tmp_path / "runs" / "smoke" / "adapter"
    assert main(["eval", str(SMOKE), *overrides, f"eval.adapter={adapter}", f"train.output_dir={tmp_path / 'evals'}",
                 f"tracking.uri=sqlite:///{tmp_path / 'eval.db'}"]) == 0
    (actors,) = (tmp_path / "evals" / "evals").glob("smoke-*/eval")
    assert _predictions(actors) == _predictions(folder)
