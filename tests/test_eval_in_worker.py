"""Evaluation in the training worker (`eval.in_worker`): the model a worker trained, its adapter merged as an
evaluation actor merges it, makes the actor path's predictions and metrics, resumes as it does, and the switch turns
it off (`clozemath.eval.folder`, `ray_jobs.train.EvaluatedHere`)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from clozemath import console
from clozemath.config import ExperimentConfig
from clozemath.eval import evaluate
from clozemath.eval import folder as eval_folder
from clozemath.eval.evaluate import eval_problems, evaluate_batch, prompting
from clozemath.eval.folder import evaluate_trained, evaluates_in_worker
from clozemath.eval.predictions import read_predictions
from clozemath.model.load import Loaded, load_model, save_adapter, trained_for_inference
from clozemath.plan import load_config
from clozemath.records import partial_predictions_file, predictions_file

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

    config = _config("eval.batch_size=auto")  # each path decodes all of a set's problems at once
    adapter = tmp_path / "adapter"
    trained = _trained(config, adapter)
    with _bars() as on_actors:
        actors = evaluate_on_ray(config, adapter, tmp_path / "actors")
    with _bars() as in_worker:
        worker = evaluate_trained(config, trained, adapter, tmp_path / "worker")
    for bars in (on_actors, in_worker):  # the actor's predictions reach the driver one by one, as the worker's do
        assert bars == {"gsm8k": [(done, 8) for done in range(9)], "gsm_p1": [(done, 6) for done in range(7)]}

    made = _predictions(tmp_path / "worker")
    assert made == _predictions(tmp_path / "actors") and set(made) == {"gsm8k", "gsm_p1"}
    assert any(p["generation"] for rows in made.values() for p in rows)
    assert set(worker) == set(actors)
    assert {key: value for key, value in worker.items() if "/seconds" not in key and not key.endswith("_s")} == {
        key: value for key, value in actors.items() if "/seconds" not in key and not key.endswith("_s")}
    assert 0 < worker["eval/load_s"] <= worker["eval/startup_s"] < worker["eval/seconds"]


@contextmanager
def _bars() -> Iterator[dict[str, list[tuple[int, int]]]]:
    """The evaluation bars' moves, by set: (done, total) each time."""
    moves: dict[str, list[tuple[int, int]]] = {}

    def progress(key, label, done, total, stats=(), rate_unit=None):
        moves.setdefault(key.rsplit("/", 1)[1], []).append((done, total))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(console, "progress", progress)
        yield moves


def _here(config: ExperimentConfig, tmp_path: Path) -> tuple[Path, eval_folder.ReadyModel]:
    """An adapter and the model a worker makes of it (`evaluate_trained`'s), to evaluate with as often as a test
    needs (`predict_here`)."""
    adapter = tmp_path / "adapter"
    merged = trained_for_inference(config.model, _trained(config, adapter), adapter)
    return adapter, eval_folder.ReadyModel(merged, config, prompting(config), 0.0, 0.0)


def test_the_bar_moves_with_each_prediction_once_it_is_on_disk(tmp_path, monkeypatch):
    """The quickstart's case: one batch holds every problem (`eval.batch_size: auto`), yet the bar moves once a
    prediction, in order, each already appended to the set's partial file (a crash then keeps it); the predictions
    are those of the batch decoded and graded whole."""
    config = _config("eval.sets=[{dataset: gsm8k, limit: 5}]", "eval.decodings=[greedy]", "eval.batch_size=auto")
    adapter, model = _here(config, tmp_path)
    folder = tmp_path / "eval"
    partial = partial_predictions_file(folder, "gsm8k")
    moves = []

    def progress(key, label, done, total, stats=(), rate_unit=None):
        on_disk = len(partial.read_text().splitlines()) if partial.is_file() else 0
        moves.append((done, total, on_disk))

    monkeypatch.setattr(console, "progress", progress)
    eval_folder.evaluate_into_folder(config, adapter, folder, eval_folder.predict_here(model))
    assert moves == [(0, 5, 0)] + [(done, 5, done) for done in range(1, 6)]

    problems = eval_problems(config.eval.sets[0])
    whole = evaluate_batch(model.loaded, problems, "greedy", config.eval, model.prompting)
    assert _predictions(folder) == {"gsm8k": [vars(prediction) for prediction in whole]}


def test_between_predictions_each_look_of_the_decoder_tells_the_sets_bar_where_its_batch_is(tmp_path, monkeypatch):
    """The quickstart's stall (every problem of a batch looping to `max_new_tokens` moves the bar only at its end):
    meanwhile each look of the decoder, greedy's and beam search's, reaches the set's bar as its status
    (`console.status`, which sends one every 10 s at most)."""
    config = _config("eval.sets=[{dataset: gsm8k, limit: 3}]", "eval.batch_size=auto")
    adapter, model = _here(config, tmp_path)
    statuses = []
    monkeypatch.setattr(console, "status", lambda key, text: statuses.append((key, text)))
    eval_folder.evaluate_into_folder(config, adapter, tmp_path / "eval", eval_folder.predict_here(model))
    assert {key for key, _ in statuses} == {eval_folder.set_bar(config.name, "gsm8k")}
    looks = [re.fullmatch(r"(greedy|beam) decoding ([1-3]) problems?, token ([1-5])/6", text) for _, text in statuses]
    assert all(looks) and {look[1] for look in looks} == {"greedy", "beam"}


def killed_at(prediction: int, config, adapter, model, folder: Path, monkeypatch) -> list[str]:
    """An evaluation into `folder` interrupted (KeyboardInterrupt) at its `prediction`-th prediction; the ids of
    those made before it."""
    graded = evaluate._prediction
    made = []

    def killed_there(problem, *args):
        if len(made) == prediction - 1:
            raise KeyboardInterrupt
        made.append(problem.id)
        return graded(problem, *args)

    monkeypatch.setattr(evaluate, "_prediction", killed_there)
    with pytest.raises(KeyboardInterrupt):
        eval_folder.evaluate_into_folder(config, adapter, folder, eval_folder.predict_here(model))
    monkeypatch.setattr(evaluate, "_prediction", graded)
    return made


def evaluated_again(config, adapter, model, folder: Path) -> tuple[dict[str, float], list[str]]:
    """The evaluation into `folder` run again to its end: its metrics, and the ids of the problems it decoded."""
    decoded = []

    def noted(problems, take):
        decoded.extend(problem.id for problem in problems)
        eval_folder.predict_here(model)(problems, take)

    return eval_folder.evaluate_into_folder(config, adapter, folder, noted), decoded


def test_an_evaluation_killed_inside_a_batch_keeps_the_predictions_made_and_makes_only_the_rest(tmp_path,
                                                                                                monkeypatch):
    """Killed at its third prediction, inside its first batch of 4 problems: the two made are on disk and taken up,
    the next evaluation decodes only the others, and the set's predictions are those of one evaluation that was not
    killed (decode batches of one prompt: the same tokens in any batch), none lost, none twice."""
    config = _config("eval.sets=[{dataset: gsm8k, limit: 6}]", "eval.decodings=[greedy]")
    adapter, model = _here(config, tmp_path)
    folder = tmp_path / "eval"
    made = killed_at(3, config, adapter, model, folder, monkeypatch)
    kept = read_predictions(partial_predictions_file(folder, "gsm8k"))
    assert [prediction.id for prediction in kept] == made

    values, decoded = evaluated_again(config, adapter, model, folder)
    problems = [problem.id for problem in eval_problems(config.eval.sets[0])]
    assert decoded == [problem for problem in problems if problem not in made]
    assert values["eval/gsm8k/greedy/total"] == 6 and not partial_predictions_file(folder, "gsm8k").exists()
    eval_folder.evaluate_into_folder(config, adapter, tmp_path / "whole", eval_folder.predict_here(model))
    assert _predictions(folder) == _predictions(tmp_path / "whole")
    assert [row["id"] for row in _predictions(folder)["gsm8k"]] == problems


def test_predictions_made_with_other_gpu_kernels_are_not_taken_up(tmp_path, monkeypatch):
    """A killed evaluation's predictions are taken up only by one that decodes with the same kernels on a GPU
    (`INFERENCE_LEVERS`: liger's change bf16 tokens): after a change of them the set starts afresh, never mixed."""
    from clozemath.model import speed

    config = _config("eval.sets=[{dataset: gsm8k, limit: 4}]", "eval.decodings=[greedy]")
    adapter, model = _here(config, tmp_path)
    folder = tmp_path / "eval"
    made = killed_at(3, config, adapter, model, folder, monkeypatch)
    monkeypatch.setattr(speed, "INFERENCE_LEVERS", speed.PLAIN)  # the kernels of the version before
    values, decoded = evaluated_again(config, adapter, model, folder)
    assert len(made) == 2 and decoded == [problem.id for problem in eval_problems(config.eval.sets[0])]
    assert values["eval/gsm8k/greedy/total"] == 4


def test_a_set_finished_with_other_gpu_kernels_is_not_taken_up_once_an_evaluation_with_these_was_killed(
    tmp_path, monkeypatch
):
    """The kernels of before finish gsm8k and are killed in GSM-P1; the current ones start and are killed at once;
    the next evaluation decodes every problem of both sets again: the finished gsm8k of the kernels before went when
    the current ones started, and is not taken up as theirs (it was, kept until they rewrote it)."""
    from clozemath.model import speed

    config = _config("eval.sets=[{dataset: gsm8k, limit: 2}, {dataset: gsm_p1, limit: 2, per_template: 1}]",
                     "eval.decodings=[greedy]")
    adapter, model = _here(config, tmp_path)
    folder = tmp_path / "eval"
    current = speed.INFERENCE_LEVERS
    monkeypatch.setattr(speed, "INFERENCE_LEVERS", speed.PLAIN)
    assert len(killed_at(3, config, adapter, model, folder, monkeypatch)) == 2
    assert predictions_file(folder, "gsm8k").is_file()  # finished before the kill
    monkeypatch.setattr(speed, "INFERENCE_LEVERS", current)
    assert killed_at(1, config, adapter, model, folder, monkeypatch) == []
    values, decoded = evaluated_again(config, adapter, model, folder)
    assert decoded == [problem.id for eval_set in config.eval.sets for problem in eval_problems(eval_set)]
    assert values["eval/gsm8k/greedy/total"] == values["eval/gsm_p1/greedy/total"] == 2


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

    def killed_at_the_second_batch(model, problems, take):
        batches.append([problem.dataset for problem in problems])
        if len(batches) == 2:
            raise KeyboardInterrupt
        return predict_rows(model, problems, take)

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
    assert all(f"[smoke] eval gsm8k {done}/3 [" in console for done in (1, 2, 3))  # the worker's bar, problem by problem
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
