"""`lease/choose_lrs.py`: the sweep's best rate per method, written into the grids that train at it; the lease's grids
and `lease/replication_lease.sh`'s chain of commands (no Ray)."""

from __future__ import annotations

import re
import importlib.util
import shutil
from pathlib import Path

import pytest

from clozemath import tracking
from clozemath.config import TrackingConfig
from clozemath.plan import load_plan

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("choose_lrs", ROOT / "lease" / "choose_lrs.py")
choose = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(choose)

SWEEP = {  # method -> rate -> held-out accuracy (made up): IT ties at 3e-4 and 1e-3, ClozeMath's best is the top
    "it": {5e-5: 0.010, 3e-4: 0.030, 1e-3: 0.030}, "mft": {5e-5: 0.012, 3e-4: 0.022, 1e-3: 0.020},
    "clozemath": {5e-5: 0.020, 3e-4: 0.030, 1e-3: 0.046}, "clozemath_causal": {5e-5: 0.01, 3e-4: 0.02, 1e-3: 0.01},
    "random_span": {5e-5: 0.03, 3e-4: 0.01, 1e-3: 0.01}, "it_prefixlm": {5e-5: 0.01, 3e-4: 0.01, 1e-3: 0.02},
}


@pytest.fixture
def sweep_store(tmp_path: Path) -> str:
    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="sweep")
    parent = tracking.start_run(config, "sweep", tags={"role": "grid"}).run_id
    for method, rates in SWEEP.items():
        for rate, accuracy in rates.items():
            name = f"sweep/method={method},lr={rate}"
            tags = {"model": "m", "method": method, "train_set": "gsm8k", "seed": "0", "role": "trial", "trial": name}
            run = tracking.start_run(config, name, parent, tags)
            run.log_params({"train.lr": rate})
            run.log_metrics(1, {"eval/gsm8k/greedy/accuracy": accuracy})
            run.end()
    return config.uri


@pytest.fixture
def grids(tmp_path: Path) -> list[Path]:
    """Copies of the committed grids, beside the models and methods they name."""
    folder = tmp_path / "configs"
    (folder / "grids").mkdir(parents=True)
    for kind in ("models", "methods"):
        (folder / kind).symlink_to(ROOT / "configs" / kind)
    return [Path(shutil.copy(ROOT / "configs" / "grids" / name, folder / "grids" / name))
            for name in ("replication_matched.yaml", "table4.yaml")]


def test_the_grids_refuse_to_start_until_their_rates_are_chosen(grids: list[Path]) -> None:
    """The committed grids hold the rates the 2026-11-27 lease chose; with a rule's rate back at null, a grid
    refuses to start."""
    for grid in grids:
        load_plan(grid)
        grid.write_text(re.sub(r"train\.lr: [0-9.e-]+\}\}.*", "train.lr: null}}", grid.read_text()))
        with pytest.raises(Exception, match=r"has no learning rate of its own \(its rule sets null\)"):
            load_plan(grid)


def test_each_method_gets_its_best_held_out_rate(sweep_store: str, grids: list[Path], tmp_path: Path, capsys) -> None:
    out = tmp_path / "choices.md"
    assert choose.main(["--experiment", "sweep", "--tracking-uri", sweep_store, "--grids", *map(str, grids),
                        "--out", str(out)]) == 0
    main_grid, table4 = (load_plan(grid).experiments for grid in grids)
    rates = {e.method.name: e.train.lr for e in main_grid if e.method.trains}
    assert rates == {"clozemath": 1e-3, "mft": 3e-4, "it": 3e-4}  # IT's tie: the lower rate
    assert {e.method.name: e.train.lr for e in table4} == {
        "clozemath_causal": 3e-4, "random_span": 5e-5, "it_prefixlm": 1e-3}
    text = grids[0].read_text()
    assert ("  - {when: {method: clozemath}, set: {train.lr: 1.0e-3}}  # held out: 5.0e-5 2.0%, 3.0e-4 3.0%, "
            "1.0e-3 4.6% (lease/choose_lrs.py)\n") in text
    table = capsys.readouterr().out
    assert "| clozemath | 1.0e-3 (the sweep's edge: a rate beyond it might do better) |" in table
    assert "| mft | 3.0e-4 | 5.0e-5 1.2%, 3.0e-4 2.2%, 1.0e-3 2.0% |" in table
    assert out.read_text().strip() in table
    # run again on its own output: the same rates, the comment replaced rather than added to
    assert choose.main(["--experiment", "sweep", "--tracking-uri", sweep_store, "--grids", str(grids[0])]) == 0
    assert grids[0].read_text() == text


def test_a_rule_for_a_method_the_sweep_lacks_writes_nothing(sweep_store: str, grids: list[Path], capsys) -> None:
    before = [grid.read_text() for grid in grids]
    grids[1].write_text(before[1] + "  - {when: {method: mft_other}, set: {train.lr: null}}\n")
    before[1] = grids[1].read_text()
    assert choose.main(["--experiment", "sweep", "--tracking-uri", sweep_store, "--grids", *map(str, grids)]) == 2
    assert "a rate rule for 'mft_other', which the sweep did not train" in capsys.readouterr().err
    assert [grid.read_text() for grid in grids] == before


@pytest.mark.parametrize(("rate", "text"), [(5e-5, "5.0e-5"), (3e-4, "3.0e-4"), (1.25e-4, "1.25e-4"), (1e-3, "1.0e-3")])
def test_rates_are_written_as_yaml_numbers(rate: float, text: str) -> None:
    import yaml

    assert choose.rate_text(rate) == text and yaml.safe_load(text) == rate


def test_the_lease_grids_expand_to_the_planned_trials(sweep_store: str, grids: list[Path]) -> None:
    """Stage 1: 6 methods x 3 rates on train[:-500], graded on train[-500:]; stage 2: base + 3 methods x 5 seeds, and
    Table 4's 3 ablations x 3 seeds; all at IT's steps in one epoch, a fifth of a GPU each (20 slots on 4 GPUs)."""
    sweep = load_plan(ROOT / "configs" / "grids" / "replication_matched_lr.yaml").experiments
    assert len(sweep) == 18 and {e.train.lr for e in sweep} == {5e-5, 3e-4, 1e-3}
    assert {(e.data.split, e.eval.sets[0].split) for e in sweep} == {("train[:-500]", "train[-500:]")}
    assert choose.main(["--experiment", "sweep", "--tracking-uri", sweep_store, "--grids", *map(str, grids)]) == 0
    main_grid, table4 = (load_plan(grid).experiments for grid in grids)
    assert len(main_grid) == 16 and len(table4) == 9
    for e in sweep + main_grid + table4:
        assert (e.train.budget, e.train.budget_reference, e.train.epochs, e.train.gpu_share) == ("steps", "it", 1, 0.2)
        assert e.eval.max_new_tokens == 256 and e.model.name == "smollm2-135m"
    curves = {(e.method.name, e.train.seed) for e in main_grid if e.eval.every_share == 0.1}
    assert curves == {(m, s) for m in ("it", "mft", "clozemath") for s in (0, 1, 2)}
    for e in main_grid:
        sets = {s.dataset: e.eval.decodings_of(s) for s in e.eval.sets}
        gsm8k = ["greedy"] if e.method.name == "base" else ["greedy", "beam"]
        assert sets == {"gsm8k": gsm8k, "gsm_symbolic": ["greedy"], "gsm_p1": ["greedy"], "gsm_p2": ["greedy"]}
    assert {(e.method.name, e.train.seed) for e in table4} == {
        (m, s) for m in ("clozemath_causal", "random_span", "it_prefixlm") for s in (0, 1, 2)}
    assert {s.dataset for e in table4 for s in e.eval.sets} == {"gsm8k"}


def test_the_lease_chain_runs_the_sweep_then_the_rates_then_both_grids_then_the_reports(tmp_path: Path) -> None:
    """`lease/replication_lease.sh` (DRY_RUN: its commands, nothing run): every grid on one store and model folder,
    the rates chosen between the stages, Table 4 reported beside the main grid from the exported predictions."""
    import os
    import subprocess

    env = {**os.environ, "DRY_RUN": "1", "MODEL_DIR": "/m", "WORK": str(tmp_path)}
    done = subprocess.run(["bash", "lease/replication_lease.sh", "chain"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    commands = [line.split("$ ", 1)[1] for line in done.stdout.splitlines() if "] $ " in line]
    steps = [next((word for word in command.split() if word.endswith((".yaml", ".py")) or word == "report"), command)
             for command in commands]
    assert commands[0].startswith("ray start --head")
    assert steps[1:] == ["configs/grids/replication_matched_lr.yaml", "lease/choose_lrs.py",
                     "configs/grids/replication_matched.yaml", "configs/grids/table4.yaml", *["report"] * 5]
    store = f"sqlite:///{tmp_path}/mlruns.db"
    for command in commands[1:]:
        assert store in command
    for command in (commands[1], commands[3], commands[4]):
        assert f"model.path=/m train.output_dir={tmp_path}/runs tracking.uri={store}" in command
    table4 = commands[8]
    assert ("--experiment replication-matched --experiment replication-table4 --decoding greedy" in table4
            and table4.count("--predictions ") == 2)
    usage = subprocess.run(["bash", "lease/replication_lease.sh"], cwd=ROOT, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage:" in usage.stderr


FAKE_TOOLS = {
    "ray": "exit 0",
    "nvidia-smi": "exit 0",
    # a grid's driver: logs its config; Table 4's fails the first time (as its driver did at the store's creation)
    "python3": """echo "$*" >> "$WORK/calls"
case "$*" in *table4.yaml*) [ -e "$WORK/failed_once" ] || { touch "$WORK/failed_once"; exit 1; };; esac
exit 0""",
}


@pytest.mark.parametrize(("startup_s", "table4_runs"), [(300, 2), (0, 1)])
def test_the_lease_chain_starts_a_driver_that_failed_at_its_start_once_more(
    tmp_path: Path, startup_s: int, table4_runs: int
) -> None:
    """Nobody watches the detached chain: a grid driver that fails within STARTUP_S seconds runs once more (it
    resumes), one that fails later does not (its failed trials are the report's to show)."""
    import os
    import subprocess

    tools = tmp_path / "bin"
    tools.mkdir()
    for name, body in FAKE_TOOLS.items():
        (tools / name).write_text(f"#!/bin/sh\n{body}\n")
        (tools / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "PYTHON": "python3", "MODEL_DIR": "/m",
           "WORK": str(tmp_path), "STAGES": "main table4", "STARTUP_S": str(startup_s), "HOME": str(tmp_path)}
    done = subprocess.run(["bash", "lease/replication_lease.sh", "chain"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    runs = [line for line in (tmp_path / "calls").read_text().splitlines() if line.startswith("-m clozemath_cli run")]
    assert sum("table4.yaml" in run for run in runs) == table4_runs
    assert sum("replication_matched.yaml" in run for run in runs) == 1
    assert ("starting it once more" in (tmp_path / "table4.log").read_text()) == (table4_runs == 2)
    assert (tmp_path / "done").exists()


def test_the_lease_chain_for_qwen_sweeps_its_rates_on_the_same_grid_and_writes_them_into_its_own(tmp_path: Path) -> None:
    """REPLICATION=qwen: stage 1 is the SmolLM2 sweep's grid with the model, names and rates overridden (reused, not
    copied), the chosen rates go into the Qwen grid, no Table 4, and no SmolLM2 folder is needed or passed."""
    import os
    import subprocess

    env = {key: value for key, value in os.environ.items() if key != "MODEL_DIR"}
    env.update(DRY_RUN="1", REPLICATION="qwen", WORK=str(tmp_path))
    done = subprocess.run(["bash", "lease/replication_lease.sh", "chain"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    commands = [line.split("$ ", 1)[1] for line in done.stdout.splitlines() if "] $ " in line]
    sweep, choose, main = commands[1:4]
    assert sweep.split()[4] == "configs/grids/replication_matched_lr.yaml"
    assert "model=qwen2.5-coder-1.5b-instruct" in sweep and "axes.method=[clozemath,mft,it]" in sweep
    assert "--experiment replication-qwen1.5b-lr" in choose and choose.endswith(
        f"--grids configs/grids/replication_qwen1.5b.yaml --out {tmp_path}/reports/rates.md")
    assert main.split()[4] == "configs/grids/replication_qwen1.5b.yaml"
    assert not any("model.path=" in command or "table4" in command for command in commands)
    assert [c for c in commands if " report " in f" {c} " or "clozemath_cli report" in c][0].count(
        "--experiment replication-qwen1.5b ") == 1
    wrong = subprocess.run(["bash", "lease/replication_lease.sh", "chain"], cwd=ROOT, capture_output=True, text=True,
                           env={**env, "REPLICATION": "llama"}, timeout=60)
    assert wrong.returncode == 2 and "REPLICATION=llama" in wrong.stderr


def test_the_qwen_grid_is_the_matched_replication_but_for_its_model_seeds_share_and_rates() -> None:
    """configs/grids/replication_qwen1.5b.yaml keeps replication_matched.yaml's budget, sets and base model rules."""
    from clozemath.plan import load_plan

    qwen = {(e.method.name, e.train.seed): e for e in load_plan(ROOT / "configs/grids/replication_qwen1.5b.yaml").experiments}
    smol = {(e.method.name, e.train.seed): e for e in load_plan(ROOT / "configs/grids/replication_matched.yaml").experiments}
    assert set(qwen) == {(m, s) for m in ("clozemath", "mft", "it") for s in (0, 1, 2)} | {("base", 0)}
    for key, e in qwen.items():
        twin = smol[key]
        assert e.model.name == "qwen2.5-coder-1.5b-instruct" and e.train.gpu_share == 0.33
        assert (e.data, e.train.budget, e.train.budget_reference, e.train.epochs, e.train.pack_tokens) == (
            twin.data, twin.train.budget, twin.train.budget_reference, twin.train.epochs, twin.train.pack_tokens)
        assert e.model.lora == twin.model.lora
        assert [(s.dataset, s.limit, e.eval.decodings_of(s)) for s in e.eval.sets] == [
            (s.dataset, s.limit, twin.eval.decodings_of(s)) for s in twin.eval.sets]


def test_a_sweep_in_slices_is_read_from_its_trials_files_and_each_rate_takes_its_seeds_mean(
        grids: list[Path], tmp_path: Path, capsys) -> None:
    """Two seeds a rate, in two files as two slices' reports wrote them: seed 0 alone would pick 1e-4 for IT (0.62
    against 0.60), the mean of both picks 3e-4 (0.61 against 0.57); a trial listed in both files counts once."""
    import json

    def trial(method: str, rate: float, seed: int, accuracy: float) -> dict:
        name = f"sweep/method={method},lr={rate},seed={seed}"
        return {"run_id": name, "run_name": name, "tags": {"method": method, "seed": str(seed)},
                "params": {"train.lr": str(rate)}, "metrics": {"eval/gsm8k/greedy/accuracy": accuracy}}

    seed0 = [trial("it", 1e-4, 0, 0.62), trial("it", 3e-4, 0, 0.60), trial("mft", 1e-4, 0, 0.50),
             trial("clozemath", 3e-4, 0, 0.40)]
    seed1 = [trial("it", 1e-4, 1, 0.52), trial("it", 3e-4, 1, 0.62), trial("mft", 1e-4, 1, 0.54), seed0[0]]
    files = [tmp_path / "rates-1.json", tmp_path / "rates-2.json"]
    for path, rows in zip(files, [seed0, seed1]):
        path.write_text(json.dumps(rows))
    sweep = choose.read_trials_files(files, "eval/gsm8k/greedy/accuracy")
    assert sweep["it"] == {1e-4: [0.62, 0.52], 3e-4: [0.60, 0.62]}
    assert choose.main(["--trials", *map(str, files), "--grids", str(grids[0])]) == 0
    rates = {e.method.name: e.train.lr for e in load_plan(grids[0]).experiments if e.method.trains}
    assert rates == {"it": 3e-4, "mft": 1e-4, "clozemath": 3e-4}
    assert ("  - {when: {method: it}, set: {train.lr: 3.0e-4}}  # held out: 1.0e-4 57.0% (mean of 2), "
            "3.0e-4 61.0% (mean of 2) (lease/choose_lrs.py)\n") in grids[0].read_text()
    assert "| it | 3.0e-4 (the sweep's edge" in capsys.readouterr().out
