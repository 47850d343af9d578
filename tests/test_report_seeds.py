"""The report's seeds table (`clozemath.report.seeds`): a method's seeds side by side, the one far below the others
flagged, beside what its training did step by step; checked by hand on made-up trials."""

from __future__ import annotations

from dataclasses import replace

import pytest

from clozemath.report.history import ExportedHistories
from clozemath.report.render import to_markdown
from clozemath.report.runs import TrialResult
from clozemath.report.seeds import headline_column, seed_rows, seed_tables, training_signals


def steps(losses: list[float], norms: list[float]) -> dict[str, list]:
    return {"step": list(range(1, len(losses) + 1)), "train/loss": losses, "train/grad_norm": norms}


def test_training_signals_by_hand() -> None:
    """20 steps. Loss: the mean of the last 2 (a tenth): (0.5 + 0.3) / 2. Gradient norms: 1.0 but 50 at step 1 (warm-up:
    the first 2 steps are not read) and 12 and 30 at steps 8 and 15: median 1.0, so both are spikes past 10x, the
    first at step 8; the peak past warm-up 30."""
    norms = [50.0] + [1.0] * 19
    norms[7], norms[14] = 12.0, 30.0
    signals = training_signals(steps([2.0] * 18 + [0.5, 0.3], norms))
    assert signals.final_loss == pytest.approx(0.4)
    assert (signals.peak_grad_norm, signals.spikes, signals.first_spike) == (30.0, 2, 8)
    calm = training_signals(steps([1.0] * 10, [2.0] * 10))
    assert (calm.final_loss, calm.peak_grad_norm, calm.spikes, calm.first_spike) == (1.0, 2.0, 0, None)
    assert training_signals({"step": [1, 2], "train/loss": [None, 3.0]}).peak_grad_norm is None


def trial(method: str, seed: int, accuracy: float, trained: bool = True, train_set: str = "gsm8k",
          extra: dict[str, float] | None = None) -> TrialResult:
    metrics = {f"eval/{train_set}/greedy/accuracy": accuracy / 100, **(extra or {})}
    return TrialResult(f"{method}-{seed}", "qwen2.5-coder-1.5b-instruct", method, train_set, str(seed), metrics,
                       steps=20 if trained else None)


def test_a_seed_far_below_its_methods_others_is_flagged_beside_its_training() -> None:
    """IT's four seeds at 55.0, 54.8, 40.1 and 56.0: seed 2 lies 14.9 points below the median of the others (55.0),
    past 5; seed 1 0.2 below theirs (55.0 of 40.1, 55.0, 56.0). MFT's two seeds have no two others: shown, not judged.
    The base model (nothing trained) and ClozeMath's single seed are not listed."""
    trials = [trial("it", 0, 55.0), trial("it", 1, 54.8), trial("it", 2, 40.1), trial("it", 3, 56.0),
              trial("mft", 0, 50.0), trial("mft", 1, 52.0), trial("clozemath", 0, 53.0),
              trial("base", 0, 39.8, trained=False)]
    spiky = [1.0] * 20
    spiky[12] = 40.0
    histories = ExportedHistories({
        t.run_id: steps([1.0] * 20, spiky if t.run_id == "it-2" else [1.0] * 20) for t in trials if t.steps
    })
    rows = seed_rows(trials, histories, ("gsm8k", "greedy"))
    assert [(row.method, row.seed) for row in rows] == [("it", s) for s in "0123"] + [("mft", "0"), ("mft", "1")]
    gaps = {(row.method, row.seed): row.gap for row in rows}
    assert gaps[("it", "2")] == pytest.approx(-14.9)
    assert gaps[("it", "1")] == pytest.approx(-0.2)
    assert gaps[("mft", "0")] is None
    assert [row.seed for row in rows if row.far_below] == ["2"]
    assert rows[2].signals.spikes == 1 and rows[2].signals.first_spike == 13

    (table,) = seed_tables(trials, histories)
    text = to_markdown(table)
    assert "far below: IT seed 2, of 4 seeds of methods with three or more" in text
    assert "diverged in training: none, of 6" in text
    assert "| IT | 2 | 40.10 | -14.90 | 1.000 | 40.00 | 1 (step 13) |  | yes |" in text
    assert "| MFT | 0 | 50.00 | – | 1.000 | 1.00 | 0 |  |  |" in text


def test_the_seeds_are_compared_on_the_training_sets_own_test() -> None:
    """MATH-trained trials evaluated on GSM8K too: the table compares them on MATH; with no such evaluation, on the
    first there is; with none, no table."""
    gsm = {"eval/gsm8k/greedy/accuracy": 0.5}
    trials = [trial("it", seed, 30.0 + seed, train_set="math", extra=gsm) for seed in range(3)]
    assert headline_column(trials, "math") == ("math", "greedy")
    assert headline_column(trials, "gsm8k") == ("gsm8k", "greedy")
    assert headline_column([replace(trial("it", 0, 1.0), metrics={})], "math") is None
    histories = ExportedHistories({t.run_id: steps([1.0] * 5, [1.0] * 5) for t in trials})
    (table,) = seed_tables(trials, histories)
    assert "MATH" in table.title and [row[2] for row in table.rows] == ["30.00", "31.00", "32.00"]
    untrained = [trial("it", seed, 30.0, trained=False) for seed in range(3)]
    assert seed_tables(untrained, histories) == []


def test_a_seed_whose_loss_diverged_is_marked_at_its_step_by_its_own_factor() -> None:
    """ClozeMath's seed 2: loss 1.0 for 10 steps, then 10.0: the smoothed loss after k steps of 10 is
    10 - 9 * 0.9^k, which reaches 3x the lowest (1.0) at k = 3 (3.44; k = 2: 2.71), step 13. Seed 1 climbs the same way
    but its run recorded train.divergence_factor 0 (not watched): not marked. Seed 0 is flat."""
    trials = [trial("clozemath", seed, 50.0 - 20 * (seed == 2)) for seed in range(3)]
    trials[1] = replace(trials[1], params={"train.divergence_factor": "0.0"})
    histories = ExportedHistories({t.run_id: steps([1.0] * 10 + ([10.0] * 10 if t.seed != "0" else [1.0] * 10),
                                                   [1.0] * 20) for t in trials})
    rows = seed_rows(trials, histories, ("gsm8k", "greedy"))
    assert [row.signals.diverged.step if row.signals.diverged else None for row in rows] == [None, None, 13]
    (table,) = seed_tables(trials, histories)
    assert "diverged in training: ClozeMath seed 2, of 3" in table.title
    assert table.rows[2][-2:] == ["yes (13)", "yes"]
