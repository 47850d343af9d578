"""What training did, recorded: every step's gradient norm (DeepSpeed's, checked against the gradients themselves),
a run's trained steps and tokens in MLflow, every step in the report's export (`steps.json.gz`), and the compute
table's trained tokens beside the planned ones. (The tokens trained so far across a resume: tests/test_train.py.)"""

from __future__ import annotations

import gzip
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from clozemath import tracking
from clozemath_cli import main
from clozemath.config import TrackingConfig
from clozemath.report import grid_runs
from clozemath.report.history import STEPS_FILE, StoreHistories, export_steps
from clozemath.train.loop import train
from clozemath.train.step import TargetLoss
from conftest import SmokeRun
from test_train import PAD, SPECIALS, Recorder, copy_rows, experiment, tiny_peft_model


@pytest.mark.parametrize("stage", [2, 3])
def test_each_step_logs_the_norm_of_its_gradients_before_clipping(tmp_path: Path, stage: int) -> None:
    """The first step's inputs, caught on their way into the model, through a fresh copy of it by hand: the norm of
    its gradients is the one the step logged (clipped to 0.01 for the update, not for the record)."""
    caught: list[dict[str, Any]] = []
    forward = TargetLoss.forward

    def catch(self: TargetLoss, **inputs: Any) -> torch.Tensor:
        caught.append({name: value.detach().clone() if isinstance(value, torch.Tensor) else value
                       for name, value in inputs.items()})
        return forward(self, **inputs)

    recorder = Recorder(tmp_path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TargetLoss, "forward", catch)
        config = experiment(zero_stage=stage, max_steps=2, max_grad_norm=0.01)
        train(tiny_peft_model(dropout=0.0), copy_rows(16), config, specials=SPECIALS, pad_id=PAD, report=recorder)
    model = tiny_peft_model(dropout=0.0)
    TargetLoss(model)(**caught[0]).backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.requires_grad))
    assert norm > 0.01 and recorder.metrics[0].grad_norm == pytest.approx(norm, rel=1e-5)
    assert recorder.metrics[1].grad_norm > 0 and recorder.metrics[1].as_dict()["train/grad_norm"] > 0


def log_steps(run: tracking.TrackedRun, values: dict[int, dict[str, float]]) -> None:
    for step, metrics in values.items():
        run.log_metrics(step, metrics)


def test_the_steps_export_holds_every_logged_step_of_every_trained_trial(tmp_path: Path) -> None:
    """A step logged twice keeps its latest values; a run from before gradient norms were logged has none; a trial that
    trained nothing is left out; the same runs give the same bytes."""
    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="steps")
    parent = tracking.start_run(config, "grid", tags={"role": "grid"}).run_id
    runs = {}
    for method, seed in (("it", "0"), ("it", "1"), ("base", "0")):
        tags = {"model": "tiny", "method": method, "train_set": "gsm8k", "seed": seed, "role": "trial"}
        runs[method, seed] = run = tracking.start_run(config, f"grid/{method},{seed}", parent, tags)
        if method != "base":
            run.log_params({"train.planned_steps": 3, "train.trained_steps": 3})
    log_steps(runs["it", "0"], {1: {"train/loss": 2.5, "train/grad_norm": 9.0, "train/lr": 0.0, "train/tokens": 100},
                                2: {"train/loss": 2.0, "train/grad_norm": 7.0, "train/lr": 1e-3, "train/tokens": 90}})
    time.sleep(0.01)  # a later timestamp: step 2 trained again after a restart
    log_steps(runs["it", "0"], {2: {"train/loss": 1.9, "train/grad_norm": 6.0, "train/lr": 1e-3, "train/tokens": 90},
                                3: {"train/loss": 1 / 3, "train/grad_norm": 1e9, "train/lr": 5e-4, "train/tokens": 80}})
    log_steps(runs["it", "1"], {step: {"train/loss": 3.0 - step, "train/lr": 1e-3, "train/tokens": 100}
                                for step in (1, 2, 3)})
    for run in runs.values():
        run.end()

    _, results = grid_runs(config.uri, "steps")
    path = export_steps(results, StoreHistories(config.uri), tmp_path / STEPS_FILE)
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        trials = json.load(handle)
    assert [(t["method"], t["seed"]) for t in trials] == [("it", "0"), ("it", "1")]
    first, second = trials
    assert first["run_id"] == runs["it", "0"].run_id and first["run_name"] == "grid/it,0"
    assert first["step"] == [1, 2, 3]
    assert first["train/loss"] == [2.5, 1.9, 0.3333333] and first["train/grad_norm"] == [9.0, 6.0, 1e9]
    assert first["train/lr"] == [0.0, 1e-3, 5e-4] and first["train/tokens"] == [100, 90, 80]
    assert "train/grad_norm" not in second and second["train/loss"] == [2.0, 1.0, 0.0]
    again = export_steps(results, StoreHistories(config.uri), tmp_path / "again.json.gz")
    assert again.read_bytes() == path.read_bytes()


def history(config: TrackingConfig, run_id: str, metric: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in tracking.client(config.uri).get_metric_history(run_id, metric))


@pytest.mark.slow
def test_a_run_records_what_its_training_did(smoke_run: SmokeRun, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The session's smoke run (2 ZeRO-2 workers, 8 steps): its trained steps and tokens as params (the tokens those
    of its steps, summed), every step's gradient norm and tokens so far; `clozemath report` prints the trained tokens
    and exports every step as MLflow holds it."""
    assert smoke_run.code == 0, "\n".join(smoke_run.lines)
    config = smoke_run.config().tracking
    (run,) = tracking.find_runs(config, {"role": "trial"})
    params = run.data.params
    tokens = history(config, run.info.run_id, "train/tokens")
    assert [step for step, _ in tokens] == list(range(1, 9)) and all(n > 0 for _, n in tokens)
    assert params["train.trained_steps"] == params["train.planned_steps"] == "8"
    assert int(params["train.trained_tokens"]) == sum(n for _, n in tokens) > 0
    so_far = [sum(n for _, n in tokens[:step]) for step in range(1, 9)]
    assert [n for _, n in history(config, run.info.run_id, "train/trained_tokens")] == so_far
    norms = history(config, run.info.run_id, "train/grad_norm")
    assert len(norms) == 8 and all(0 < n < math.inf for _, n in norms)

    assert main(["report", "--experiment", config.experiment, "--tracking-uri", config.uri, "--out", str(tmp_path),
                 "--decoding", "greedy"]) == 0
    compute = capsys.readouterr().out.split("**Compute")[1]
    assert f"| {int(params['train.trained_tokens']):,} | {int(params['train.planned_tokens']):,} |" in compute
    with gzip.open(tmp_path / STEPS_FILE, "rt", encoding="utf-8") as handle:
        (exported,) = json.load(handle)
    assert exported["run_id"] == run.info.run_id and exported["step"] == list(range(1, 9))
    for metric in ("train/loss", "train/grad_norm"):
        logged = history(config, run.info.run_id, metric)
        assert exported[metric] == pytest.approx([value for _, value in logged], rel=1e-6)


def test_the_loop_warns_at_the_step_its_loss_diverged_and_at_its_end_whether_it_came_back(tmp_path: Path) -> None:
    """A rate of 30 with no clipping blows the tiny model's loss up: the loop warns once at the step the rule finds
    in the losses it logged (`clozemath.train.divergence`), trains on to the end, and there warns again with how the
    run ended, as the rule finds it over all its losses (ended diverged, or back under the mark from a step); a rate
    that trains well warns never."""
    from clozemath.train.divergence import find_divergence

    for lr, diverges in ((30.0, True), (3e-2, False)):
        warned: list[str] = []
        recorder = Recorder(tmp_path / str(lr))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("clozemath.console.warn", warned.append)
            config = experiment(zero_stage=2, max_steps=24, lr=lr, max_grad_norm=0.0, warmup_ratio=0.0)
            train(tiny_peft_model(dropout=0.0), copy_rows(64), config, specials=SPECIALS, pad_id=PAD,
                  report=recorder)
        assert len(recorder.metrics) == 24
        found = find_divergence([(m.step, m.loss) for m in recorder.metrics], config.train.divergence_factor)
        assert (found is not None) == diverges
        if found is None:
            assert warned == []
            continue
        first = replace(found, back=None)  # at the step it diverged, where it ends is not known yet
        assert warned == [f"[loop] training {first.describe()}; the run goes on (train.divergence_factor)",
                          f"[loop] training {found.ending()}"]
        assert warned[1].startswith("[loop] training ended diverged (" if found.ended_diverged
                                    else "[loop] training came back (")
