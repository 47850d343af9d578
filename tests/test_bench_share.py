"""The evaluation-share benchmark (`bench/eval_share.py`): its shares read back from a grid's MLflow store, worked out
by hand; the command it runs."""

from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient

from bench import eval_share


def _side(folder: Path, trials: list[tuple[str, float, dict[str, float]]], wall: float | None = None) -> Path:
    """A grid run of `eval_share.EXPERIMENT` in `folder`'s store whose trials (method, run seconds, metrics) ran from
    t = 1000 s."""
    folder.mkdir()
    client = MlflowClient(f"sqlite:///{folder / 'mlruns.db'}")
    experiment = client.create_experiment(eval_share.EXPERIMENT)
    parent = client.create_run(experiment, start_time=1_000_000, tags={"role": "grid"}).info.run_id
    for seed, (method, seconds, metrics) in enumerate(trials):
        tags = {"mlflow.parentRunId": parent, "role": "trial", "model": "smollm2-135m", "method": method,
                "train_set": "gsm8k", "seed": str(seed)}
        run = client.create_run(experiment, start_time=1_000_000, tags=tags).info.run_id
        for key, value in metrics.items():
            client.log_metric(run, key, value)
        client.set_terminated(run, end_time=1_000_000 + int(seconds * 1000))
    client.set_terminated(parent, end_time=1_500_000)
    if wall is not None:
        (folder / eval_share.WALL_FILE).write_text(f"{wall}\n")
    return folder


def test_the_shares_of_a_side_before_and_after(tmp_path: Path) -> None:
    before = _side(tmp_path / "before", [("base", 400.0, {"eval/seconds": 350.0}),
                                         ("it", 450.0, {"eval/seconds": 350.0})])
    after = _side(tmp_path / "after", [
        ("base", 100.0, {"eval/seconds": 90.0, "eval/startup_s": 20.0, "eval/decode_s": 70.0}),
        ("it", 200.0, {"eval/seconds": 80.0, "eval/startup_s": 10.0, "eval/decode_s": 70.0})], wall=210.0)
    text = eval_share.show([before, after])
    # before: (350 + 350) of (400 + 450) s = 82%, no start-up recorded, the grid run's 500 s as the wall
    assert "| before | 500 | 2 | 850 | 82% | – |" in text
    # after: (90 + 80) of 300 s = 57%; starting (20 + 10) / 300 = 10%, 20 s the longest; the command's 210 s
    assert "| after | 210 | 2 | 300 | 57% | 10% (20 s at most) |" in text
    assert text.count("**Compute: time per trial**") == 2


def test_a_side_runs_the_matched_grid_with_the_checkout_given(tmp_path: Path, monkeypatch) -> None:
    ran = {}

    def run(command, cwd, env, **_):
        ran.update(command=command, cwd=cwd, pythonpath=env["PYTHONPATH"])
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(eval_share.subprocess, "run", run)
    eval_share.run_side(tmp_path / "code", tmp_path / "out", "/models/smol", [0, 1], ["train.gpu_share=0.25"])
    assert ran["cwd"] == tmp_path / "code" and ran["pythonpath"] == str(tmp_path / "code")
    assert ran["command"][3:] == [
        "run", eval_share.GRID, "model.path=/models/smol", "eval.every_share=null", "axes.train.seed=[0,1]",
        f"train.output_dir={tmp_path / 'out' / 'runs'}", f"tracking.uri=sqlite:///{tmp_path / 'out' / 'mlruns.db'}",
        "train.gpu_share=0.25"]
    assert float((tmp_path / "out" / eval_share.WALL_FILE).read_text()) >= 0
