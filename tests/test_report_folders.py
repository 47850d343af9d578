"""`clozemath report --from DIR ...`: a study's slices, each a grid run whose store stays behind, reported as one from
their report folders alone (trials.json, steps.json.gz, predictions.jsonl.gz): the same report as one store holding
every slice, a trial two folders hold reported once, and a bad folder one line naming its file (no Ray)."""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest

from clozemath import tracking
from clozemath.config import TrackingConfig
from clozemath_cli import main

PROBLEMS = 200
RIGHT = {"base": 40, "it": 90, "clozemath": 110}
"""Seed s of a method is right on problems [0, RIGHT + 6 s) (base: 40)."""
SLICES = {"a": [("base", 0), ("it", 0), ("it", 1), ("clozemath", 0)],
          "b": [("it", 2), ("clozemath", 1), ("clozemath", 2)],
          "rerun": [("clozemath", 2)], "rate": [("it", 2)]}
"""The grid runs: slices a and b of the study; `rerun`, b's ClozeMath seed 2 run again elsewhere (right on 3 fewer);
`rate`, IT seed 2 at another rate."""
FILES = ("tables.md", "summary.md", "trials.json", "steps.json.gz", "accuracy_vs_steps.png")


def log_trial(config: TrackingConfig, parent: str, method: str, seed: int, folder: Path, grid: str) -> str:
    trial = f"study/method={method},seed={seed}"
    tags = {"model": "smollm2-135m", "method": method, "train_set": "gsm8k", "seed": str(seed), "role": "trial",
            "trial": trial}
    run = tracking.start_run(config, trial, parent, tags)
    right = RIGHT[method] + (0 if method == "base" else 6 * seed) - (3 if grid == "rerun" else 0)
    run.log_params({"train.lr": 1e-3 if grid == "rate" else 3e-4, "train.output_dir": f"/machines/{grid}/runs",
                    "eval.sets": "gsm8k"})
    if method != "base":
        run.log_params({"train.planned_steps": 20, "train.planned_tokens": 20_000, "train.trained_steps": 20,
                        "train.trained_tokens": 19_000 + seed})
        for step in range(1, 21):
            run.log_metrics(step, {"train/loss": 2.0 / step + seed / 100, "train/grad_norm": 1.0 + step / 7,
                                   "train/lr": 3e-4, "train/tokens": 950 + seed})
        for step in (10, 20):  # Figure 3's points: the same 20 problems during training
            run.log_metrics(step, {"curve/gsm8k/greedy/accuracy": (right * step / 20 % 20) / 20})
    rows = [{"id": f"p{i:03d}", "dataset": "gsm8k", "decoding": "greedy", "generation": f"#### {i}", "gold": "1",
             "correct": i < right, "extracted": str(i), "rule": "strict", "finish_reason": "eos"}
            for i in range(PROBLEMS)]
    predictions = folder / grid / method / str(seed) / "predictions"
    predictions.mkdir(parents=True)
    (predictions / "gsm8k.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run.log_artifacts(predictions.parent, "eval")  # as ray_jobs/eval_job.py logs them
    run.log_metrics(20, {"eval/gsm8k/greedy/accuracy": right / PROBLEMS, "eval/gsm8k/greedy/correct": right,
                         "eval/gsm8k/greedy/total": PROBLEMS})
    run.end()
    return run.run_id


@pytest.fixture(scope="module")
def slices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each grid run's report folder (with its predictions exported, as bench/slice_lease.sh makes it), and `both`:
    the report of one store holding slices a and b."""
    folder = tmp_path_factory.mktemp("slices")
    config = TrackingConfig(uri=f"sqlite:///{folder / 'mlruns.db'}", experiment="study")
    parents = {}
    for grid, trials in SLICES.items():
        parents[grid] = tracking.start_run(config, grid, tags={"role": "grid"}).run_id
        for method, seed in trials:
            log_trial(config, parents[grid], method, seed, folder, grid)
    argv = ["report", "--experiment", "study", "--tracking-uri", config.uri, "--decoding", "greedy",
            "--export-predictions", "compact"]
    reports = {}
    for name, grids in (*((grid, [grid]) for grid in SLICES), ("both", ["a", "b"])):
        reports[name] = folder / "reports" / name
        parent_args = [arg for grid in grids for arg in ("--parent", parents[grid])]
        assert main([*argv, *parent_args, "--out", str(reports[name])]) == 0
    return reports


def report_from(folders: list[Path], out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["report", *(arg for f in folders for arg in ("--from", str(f))), "--decoding", "greedy",
                 "--export-predictions", "compact", "--out", str(out)]) == 0
    return capsys.readouterr().out


def test_the_slices_folders_make_the_report_of_one_store_holding_them_all(
    slices: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Slices a and b (IT and ClozeMath split across them) from their folders: every file is the one the store
    holding both makes, byte for byte: the tables with their intervals over seeds and problems, the orderings, the
    compute table, Figure 3 and every trial's steps."""
    capsys.readouterr()
    out = report_from([slices["a"], slices["b"]], tmp_path, capsys)
    assert "2 report folders: 7 trials" in out and "note:" not in out
    for name in (*FILES, "predictions.jsonl.gz"):
        assert (tmp_path / name).read_bytes() == (slices["both"] / name).read_bytes(), name
    tables = (tmp_path / "tables.md").read_text()
    # ClozeMath - IT: seeds right on 110/116/122 and 90/96/102 of 200: +10.00 points, its interval over seeds
    comparison = next(line for line in tables.splitlines() if line.startswith("| GSM8K greedy | ClozeMath | IT |"))
    assert "| +10.00 | [" in comparison and "(paired seeds)" not in comparison
    assert "| GSM8K | SmolLM2-135M-Instruct | ClozeMath | 2 | 20 | 19,002 | 20,000 |" in tables  # compute
    with gzip.open(tmp_path / "steps.json.gz", "rt", encoding="utf-8") as handle:
        steps = {(t["method"], t["seed"]): t for t in json.load(handle)}
    assert sorted(steps) == [("clozemath", "0"), ("clozemath", "1"), ("clozemath", "2"), ("it", "0"), ("it", "1"),
                             ("it", "2")]
    curve = steps["clozemath", "1"]
    assert curve["step"] == list(range(1, 21)) and curve["curve/gsm8k/greedy/accuracy"][9] == (116 * 10 / 20 % 20) / 20
    assert [v for v in curve["curve/gsm8k/greedy/accuracy"] if v is not None] == [(116 / 2 % 20) / 20, 116 % 20 / 20]


def test_a_trial_two_folders_hold_is_reported_once_and_said_which(
    slices: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ClozeMath seed 2 run again on another machine (`rerun`, 3 answers fewer right): the folder given first is
    reported, and a note names both runs; the same folder twice is the same run, reported once."""
    capsys.readouterr()
    out = report_from([slices["a"], slices["b"], slices["rerun"]], tmp_path / "first", capsys)
    (note,) = [line for line in out.splitlines() if line.startswith("note:")]
    assert note.startswith("note: study/method=clozemath,seed=2 is in ") and f"and {slices['rerun']} (run " in note
    assert note.endswith(f"reported once, {slices['b']}'s (given first)")
    for name in FILES:  # the rerun's other answers left out
        assert (tmp_path / "first" / name).read_bytes() == (slices["both"] / name).read_bytes(), name
    out = report_from([slices["a"], slices["rerun"], slices["b"]], tmp_path / "rerun", capsys)
    assert f"reported once, {slices['rerun']}'s (given first)" in out
    kept = [55, 58, 59.5]  # ClozeMath seeds 0-2: 110, 116 and the rerun's 119 of 200
    assert f"| {statistics.fmean(kept):.2f} ± {statistics.stdev(kept):.2f} (3) |" in out.split("**Results")[1]
    out = report_from([slices["a"], slices["a"]], tmp_path / "twice", capsys)
    assert out.count("note:") == 4 and "(the same run)" in out and "2 report folders: 4 trials" in out
    assert (tmp_path / "twice" / "tables.md").read_bytes() == (slices["a"] / "tables.md").read_bytes()


def test_runs_of_one_trial_with_other_settings_are_refused_in_one_line(
    slices: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """IT seed 2 at 1e-3 (`rate`) beside the slice that ran it at 3e-4: pooled they would pass for one trial. Where
    each ran (`train.output_dir` differs too) is no setting."""
    capsys.readouterr()
    assert main(["report", "--from", str(slices["b"]), "--from", str(slices["rate"])]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(slices["b"]) in err and str(slices["rate"]) in err
    assert "both hold study/method=it,seed=2 of smollm2-135m on gsm8k, with other settings (train.lr: 0.0003 -> " \
           "0.001)" in err and "output_dir" not in err


def test_a_slice_folder_holding_its_report_is_read_and_a_bad_file_is_one_line_naming_it(
    slices: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A slice as bench/slice_lease.sh brings it back holds report/; a missing, damaged or foreign file is named."""
    import shutil

    slice_folder = tmp_path / "gsm8k-s0"
    shutil.copytree(slices["a"], slice_folder / "report")
    capsys.readouterr()
    report_from([slice_folder], tmp_path / "from_slice", capsys)
    assert (tmp_path / "from_slice" / "tables.md").read_bytes() == (slices["a"] / "tables.md").read_bytes()

    def refused(folder: Path) -> str:
        assert main(["report", "--from", str(folder), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        return err

    broken = tmp_path / "broken"
    shutil.copytree(slices["a"], broken)
    (broken / "predictions.jsonl.gz").unlink()
    assert f"{broken / 'predictions.jsonl.gz'}: missing" in refused(broken)
    shutil.copy(slices["b"] / "predictions.jsonl.gz", broken)
    assert f"{broken / 'predictions.jsonl.gz'}: run " in refused(broken)  # another report's
    shutil.copy(slices["a"] / "predictions.jsonl.gz", broken)
    (broken / "steps.json.gz").write_bytes(b"not gzip")
    assert f"{broken / 'steps.json.gz'}: " in refused(broken)
    with gzip.open(broken / "steps.json.gz", "wt") as handle:
        handle.write("[]")
    assert f"{broken / 'steps.json.gz'}: no steps of run " in refused(broken)  # its trained trials have none
    (broken / "trials.json").write_text('{"run_id": 1}')
    assert f"{broken / 'trials.json'}: not a trials.json file" in refused(broken)
    assert f"--from {tmp_path / 'nowhere'}: no such folder" in refused(tmp_path / "nowhere")
    for other in (["--experiment", "study"], ["--parent", "0123abcd"]):
        assert main(["report", "--from", str(slices["a"]), *other]) == 2
        assert "--from reads whole report folders" in capsys.readouterr().err
    before = {file.name: file.read_bytes() for file in broken.iterdir()}
    shutil.copytree(slices["a"], broken, dirs_exist_ok=True)
    kept = {file.name: file.read_bytes() for file in broken.iterdir()}
    for other in (["--from", str(slices["b"])], ["--exclude-diverged"]):
        assert main(["report", *other, "--from", str(broken), "--out", str(broken)]) == 2
        assert "is one of the --from folders: the report would overwrite what it reads" in capsys.readouterr().err
        assert {file.name: file.read_bytes() for file in broken.iterdir()} == kept != before  # nothing written


def test_runs_that_evaluated_other_problems_under_one_name_are_refused_in_one_line(
    slices: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rate sweep's held-out GSM8K train (`train[-500:]`) beside GSM8K test would share the column `GSM8K greedy`
    and a comparison (2026-12-05: it did); an ids file compares by name, and a run that did not record a setting is
    not compared on it."""
    import shutil

    def with_sets(name: str, **settings: str) -> Path:
        folder = tmp_path / name
        shutil.copytree(slices[name[0]], folder)
        trials = json.loads((folder / "trials.json").read_text())
        for trial in trials:
            trial["params"].update({f"eval.sets.gsm8k.{key}": value for key, value in settings.items()})
        (folder / "trials.json").write_text(json.dumps(trials))
        return folder

    def report(*folders: Path) -> int:
        capsys.readouterr()
        return main(["report", *(arg for f in folders for arg in ("--from", str(f))), "--decoding", "greedy",
                     "--out", str(tmp_path / "out")])

    held_out, test = with_sets("a_held_out", split="train[-500:]"), with_sets("b_test", split="test")
    assert report(held_out, test) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "runs evaluated other problems as 'gsm8k' (eval.sets.gsm8k.split: " \
        "train[-500:] in " in err and ", test in " in err and err.endswith("report them apart")
    assert not (tmp_path / "out").exists()
    assert report(with_sets("a_ids", ids="/one/machine/math500.txt"), with_sets("b_ids", ids="/other/math500.txt")) == 0
    assert report(held_out, slices["b"]) == 0  # b recorded no split


def test_a_run_whose_loss_diverged_is_marked_and_left_out_on_request(
    slices: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Slice b with ClozeMath seed 1's losses made 1.0 for 10 steps, then 10.0 (smoothed: 3x its lowest at step 13),
    and seed 2's 1.0 for 5, 10.0 for 5, then 1.0 (3x at step 8, 4.69 at step 10, then 1 + 3.69 * 0.9^j: under 3 from
    j = 6, step 16, to the end). The report of every run marks both in the seeds table, seed 2 as come back; with
    --exclude-diverged seed 1 alone is left out, named first in the summary, and ClozeMath's results are its seeds 0
    and 2 (110 and 122 of 200 right)."""
    import shutil

    edited = tmp_path / "b"
    shutil.copytree(slices["b"], edited)
    with gzip.open(edited / "steps.json.gz", "rt", encoding="utf-8") as handle:
        trials = json.load(handle)
    for trial in trials:
        if (trial["method"], trial["seed"]) == ("clozemath", "1"):
            trial["train/loss"] = [1.0] * 10 + [10.0] * 10
        if (trial["method"], trial["seed"]) == ("clozemath", "2"):
            trial["train/loss"] = [1.0] * 5 + [10.0] * 5 + [1.0] * 10
    with gzip.open(edited / "steps.json.gz", "wt", encoding="utf-8") as handle:
        json.dump(trials, handle)
    capsys.readouterr()
    out = report_from([slices["a"], edited], tmp_path / "all", capsys)
    assert "diverged in training: ClozeMath seed 1, of 6; diverged and came back: ClozeMath seed 2)" in out
    assert "| ClozeMath | 1 | 58.00 |" in out and "| yes (13) |" in out and "| 8, back 16 |" in out
    assert main(["report", "--from", str(slices["a"]), "--from", str(edited), "--decoding", "greedy",
                 "--exclude-diverged", "--out", str(tmp_path / "without")]) == 0
    summary = (tmp_path / "without" / "summary.md").read_text()
    assert summary.startswith("**Left out: the runs whose training diverged**")
    assert "ClozeMath seed 1 trained on GSM8K (diverged at step 13: smoothed loss 3.439, 3.4x its lowest (1.000 at " \
           "step 1))." in summary.splitlines()[0] and "seed 2" not in summary.splitlines()[0]
    results = (tmp_path / "without" / "tables.md").read_text().split("**Results")[1]
    assert f"| {statistics.fmean([55, 61]):.2f} ± {statistics.stdev([55, 61]):.2f} (2) |" in results
    with gzip.open(tmp_path / "without" / "steps.json.gz", "rt", encoding="utf-8") as handle:
        assert ("clozemath", "1") not in {(t["method"], t["seed"]) for t in json.load(handle)}
