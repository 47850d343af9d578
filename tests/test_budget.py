"""Compute budgets: equal epochs, or the steps / training tokens of a reference method (arithmetic, and a grid's
budgets with made-up footprints: no Ray started); the sets they are counted on, prepared ahead of a run (on Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clozemath.config import TrainConfig, from_wire, to_wire
from clozemath.errors import ClozeMathError
from clozemath.plan import load_config, load_plan
from clozemath.records import flatten
from clozemath.train.budget import Footprint, matched_epochs, planned_steps, planned_tokens

CLOZEMATH = Footprint(samples=1000, tokens=100_000)  # 100 tokens a sample
IT = Footprint(samples=200, tokens=40_000)  # 200 tokens a sample (the whole solution, every time)


def train(budget: str = "epochs", **changes) -> TrainConfig:
    return TrainConfig(**{"micro_batch_size": 4, "grad_accum": 2, "epochs": 2, "budget": budget, **changes})


def test_equal_epochs_give_each_method_its_own_steps() -> None:
    assert planned_steps(CLOZEMATH, train()) == 2 * 1000 // 8 == 250
    assert planned_steps(IT, train()) == 2 * 200 // 8 == 50
    assert planned_tokens(IT, train()) == 2 * 40_000


def test_a_run_ended_by_max_steps_plans_the_tokens_of_its_steps_not_of_its_epochs() -> None:
    # The quickstart's shape: 20 steps of 4 samples, of an epoch of 1000 samples (250 steps of 1 x 4).
    quick = train(epochs=1, grad_accum=1, max_steps=20)
    assert planned_tokens(CLOZEMATH, quick) == 100_000 * 20 // 250 == 8_000
    assert planned_tokens(CLOZEMATH, train(max_steps=500)) == 2 * 2 * 100_000  # twice its 2 epochs' 250 steps
    assert planned_tokens(CLOZEMATH, quick, packed=True) is None  # packed rows: laid out by the workers


def test_a_matched_budget_gives_the_reference_methods_steps_or_tokens() -> None:
    # Steps, one sample a row: IT trains 5 of its epochs to make ClozeMath's 250 steps of 2 epochs.
    steps = matched_epochs(train("steps"), CLOZEMATH, IT, packed=False)
    assert steps == 10 and planned_steps(IT, train(epochs=steps)) == 250
    # Tokens: ClozeMath sees 2 x 100,000 tokens; IT's epoch holds 40,000.
    tokens = matched_epochs(train("tokens"), CLOZEMATH, IT, packed=False)
    assert tokens == 5 and planned_tokens(IT, train(epochs=tokens)) == planned_tokens(CLOZEMATH, train())
    assert matched_epochs(train("tokens"), CLOZEMATH, CLOZEMATH, packed=False) == 2
    # Packed rows hold a fixed number of tokens a step: equal steps are equal tokens.
    assert matched_epochs(train("steps"), CLOZEMATH, IT, packed=True) == tokens


def test_the_gsm8k_epoch_gap_the_paper_leaves_open() -> None:
    """ClozeMath's 47,395 samples per GSM8K epoch against IT's 7,473: ~6.3x the steps at equal epochs."""
    paper = TrainConfig(micro_batch_size=4, grad_accum=4, epochs=3)
    ratio = planned_steps(Footprint(47_395, 1), paper) / planned_steps(Footprint(7_473, 1), paper)
    assert ratio == pytest.approx(6.34, abs=0.01)


def test_max_steps_and_a_matched_budget_cannot_both_set_the_steps() -> None:
    with pytest.raises(ClozeMathError, match="`max_steps` and `budget: steps` both set the steps"):
        load_config("configs/experiments/smoke.yaml", ["train.budget=steps", "train.max_steps=3"])
    with pytest.raises(ClozeMathError, match="no budget to match"):
        matched_epochs(train(), CLOZEMATH, IT, packed=False)


def test_the_paper_grid_states_its_budget() -> None:
    grid = load_config("configs/grids/paper.yaml", ["axes.model=[deepseek-math-7b]", "axes.method=[it]"])
    assert grid.base["train"]["budget"] == "epochs"


def test_a_grids_matched_budgets_prepare_each_training_set_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """IT and ClozeMath at IT's tokens in 1 epoch, 2 seeds, and base: 3 distinct training sets (a reference is the IT
    trial's own; IT's samples are the same at every seed; base trains nothing), prepared once each (here: made-up
    footprints, no Ray). Packed rows: ClozeMath
    gets IT's 40,000 tokens of its 100,000 + seed an epoch, IT 1 epoch; base and epochs-budget points untouched."""
    from ray_jobs import run

    prepared = []

    def footprint(config) -> Footprint:
        prepared.append((config.method.name, config.data.seed))
        return IT if config.method.name == "it" else Footprint(1000, 100_000 + config.data.seed)

    monkeypatch.setattr(run, "_footprint", footprint)
    started = []
    monkeypatch.setattr(run, "init_ray", lambda: started.append(True))  # once, before the threads that prepare
    plan = load_plan("configs/grids/smoke.yaml", [
        "axes.model=[tiny-llama]", "axes.dataset=[gsm8k]", "axes.method=[base,it,clozemath]", "axes.train.seed=[0,1]",
        "train.max_steps=null", "train.budget=tokens", "train.budget_reference=it", "train.epochs=1",
        "train.pack_tokens=512"])
    matched = run.with_budgets(plan.experiments, plan.root, parallel=2)
    assert sorted(prepared)[:2] == [("clozemath", 0), ("clozemath", 1)] and started == [True]
    assert [method for method, _ in prepared].count("it") == 1 and len(prepared) == 3
    epochs = {(e.method.name, e.train.seed): e.train.epochs for e in matched}
    assert epochs == {("base", 0): 1, ("base", 1): 1, ("it", 0): 1, ("it", 1): 1,
                      ("clozemath", 0): 40_000 / 100_000, ("clozemath", 1): 40_000 / 100_001}
    assert {e.train.budget for e in matched if e.method.trains} == {"epochs"}
    assert run.with_budgets(plan.experiments[:1], plan.root) == plan.experiments[:1]  # base alone: nothing to prepare
    # what each trial's params say: the budget as configured beside what it resolved to
    params = {(e.method.name, e.train.seed): flatten(e) for e in matched}
    clozemath = params[("clozemath", 1)]
    assert (clozemath["train.budget"], clozemath["train.epochs"]) == ("epochs", 40_000 / 100_001)
    assert (clozemath["train.budget_configured"], clozemath["train.budget_reference"],
            clozemath["train.epochs_configured"]) == ("tokens", "it", 1)
    assert params[("base", 0)]["train.budget_configured"] is None and params[("base", 0)]["train.budget"] == "tokens"
    assert from_wire(to_wire(matched[-1])) == matched[-1]  # a trial reads it back


def test_the_record_of_a_matched_budget_is_the_drivers_to_write() -> None:
    with pytest.raises(ClozeMathError, match="budget_configured"):
        load_config("configs/experiments/smoke.yaml", ["train.budget_configured=steps"])
    with pytest.raises(ClozeMathError, match="budget_configured"):
        load_config("configs/experiments/smoke.yaml", ["train.max_steps=null", "train.budget=steps",
                                                      "train.budget_configured=steps", "train.epochs_configured=1"])


def test_warm_data_prepares_what_a_run_prepares_so_that_the_run_reads_its_cache(
    ray_session: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`clozemath warm --data --no-models` on base, IT and ClozeMath at IT's tokens: the 2 training sets (IT's, also the budget's
    reference, and ClozeMath's; base trains nothing) go into the run's `<train.output_dir>/cache`, where the run's own
    preparation (the driver's, then each trial's) finds them."""
    from clozemath.records import CACHE_DIR
    from clozemath_cli import main
    from ray_jobs.grid import with_absolute_paths
    from ray_jobs.preprocess import preprocess

    overrides = ["axes.model=[tiny-llama]", "axes.dataset=[gsm8k]", "axes.method=[base,it,clozemath]",
                 "train.max_steps=null", "train.budget=tokens", "train.budget_reference=it",
                 "data.limit=4", f"train.output_dir={tmp_path / 'runs'}"]
    assert main(["warm", "configs/grids/smoke.yaml", *overrides, "--data", "--no-models"]) == 0
    said = capsys.readouterr().out
    assert "the tokenizer" not in said, said  # the models are another warm's
    cache = (tmp_path / "runs" / CACHE_DIR).resolve()
    assert f"warm: smoke-grid: 2 training set(s) in {cache}" in said, said
    made = sorted(folder.name for folder in cache.iterdir() if folder.is_dir())
    assert len(made) == 2, made
    trained = [with_absolute_paths(e) for e in load_plan("configs/grids/smoke.yaml", overrides).experiments
               if e.method.trains]
    assert len(trained) == 2
    for experiment in trained:
        assert preprocess(experiment, cache).from_cache, experiment.name
    assert sorted(folder.name for folder in cache.iterdir() if folder.is_dir()) == made


def test_warm_told_to_leave_the_models_out_needs_the_data(capsys: pytest.CaptureFixture[str]) -> None:
    from clozemath_cli import main

    assert main(["warm", "configs/grids/smoke.yaml", "--no-models"]) == 2
    assert capsys.readouterr().err.strip() == ("clozemath: error: warm --no-models: nothing left to warm; add --data "
                                               "(the training sets)")
