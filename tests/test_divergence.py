"""The rule for a training run whose loss diverged (`clozemath.train.divergence`), checked by hand."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from clozemath.config import TrainConfig
from clozemath.train.divergence import DivergenceWatch, find_divergence


def numbered(losses: list[float]) -> list[tuple[int, float]]:
    return list(enumerate(losses, start=1))


def test_a_jump_is_found_where_the_smoothed_loss_reaches_the_factor() -> None:
    """Loss 1.0 for 20 steps, then 4.0. The smoothed loss k steps after the jump is 4 - 3 * 0.9^k: 1.3, 1.57, 1.813,
    2.032, 2.229, 2.406, 2.565, 2.709, 2.838, 2.954, 3.059 (k = 11, step 31) past 3x the lowest, 1.0 at step 1."""
    found = find_divergence(numbered([1.0] * 20 + [4.0] * 20), 3.0)
    assert found is not None
    assert (found.step, found.lowest, found.lowest_step) == (31, 1.0, 1)
    assert found.loss == pytest.approx(4 - 3 * 0.9**11)
    assert "diverged at step 31" in found.describe() and "3.1x its lowest (1.000 at step 1)" in found.describe()


def test_falling_or_doubling_losses_are_not_a_divergence() -> None:
    """A loss that falls, one that doubles from its lowest (MFT's, as its masking grows: 1.9-2.2x on Qwen), and one
    spike of a single step (10x, smoothed to 1.9x) are not."""
    falling = [2.0 / (1 + step / 10) for step in range(100)]
    doubling = [0.8] * 30 + [0.8 + 0.8 * step / 70 for step in range(70)]
    spike = [1.0] * 30 + [10.0] + [1.0] * 30
    for losses in (falling, doubling, spike):
        assert find_divergence(numbered(losses), TrainConfig().divergence_factor) is None


def test_a_nan_loss_diverges_at_its_step_and_the_watch_tells_once() -> None:
    watch = DivergenceWatch(3.0)
    assert [watch.update(step, loss) for step, loss in numbered([2.0, 1.0])] == [None, None]
    first = watch.update(3, math.nan)
    assert first is not None and first.step == 3
    assert watch.update(4, 100.0) is None and watch.found is first


def test_factor_zero_watches_nothing_and_a_factor_at_most_one_is_refused() -> None:
    assert find_divergence(numbered([1.0] * 5 + [100.0] * 20), 0) is None
    assert TrainConfig(divergence_factor=0).divergence_factor == 0
    for bad in (0.5, 1.0, -2.0):
        with pytest.raises(ValidationError, match="must be 0 .not watched. or above 1"):
            TrainConfig(divergence_factor=bad)
    with pytest.raises(ValueError, match="above 1"):
        DivergenceWatch(1.0)


def test_a_run_that_comes_back_under_the_mark_to_stay_is_told_from_one_that_ends_diverged() -> None:
    """Loss 1.0 for 20 steps, 10.0 for 5, then 1.0. The smoothed loss after k steps of 10 is 10 - 9 * 0.9^k: 3.44 at
    k = 3 (step 23), past 3x the lowest; after 5 it is 4.69, and j steps of 1.0 later 1 + 3.69 * 0.9^j, under 3 from
    j = 6 (2.96; j = 5: 3.18), step 31, to the end. Ending on 10.0 instead, it never comes back; nor does one that
    comes back and surges past the mark again at its end. A NaN at the last step is no way back either."""
    back = find_divergence(numbered([1.0] * 20 + [10.0] * 5 + [1.0] * 20), 3.0)
    assert back is not None and (back.step, back.back, back.ended_diverged) == (23, 31, False)
    assert back.describe().endswith("3.4x its lowest (1.000 at step 1), back under it from step 31")
    stays = find_divergence(numbered([1.0] * 20 + [10.0] * 25), 3.0)
    assert stays is not None and (stays.step, stays.back, stays.ended_diverged) == (23, None, True)
    again = find_divergence(numbered([1.0] * 20 + [10.0] * 5 + [1.0] * 20 + [10.0] * 10), 3.0)
    assert again is not None and again.ended_diverged
    nan_end = find_divergence(numbered([1.0] * 20 + [10.0] * 5 + [1.0] * 20 + [math.nan]), 3.0)
    assert nan_end is not None and nan_end.step == 23 and nan_end.ended_diverged
