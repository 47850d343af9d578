"""The objective registry: an objective added by registering one `Objective`, and nothing else, is prepared (sample
building, balancing, the preprocessing cache key) and trained like the built-in ones."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from clozemath.config import ExperimentConfig, MethodConfig
from clozemath.data import objectives
from clozemath.data.objectives import Objective, Sample, Solution, infilling_sample, lm_repeats, register
from clozemath.data.prepare import prepare_data
from clozemath.data.tokenize import num_sentinels_needed
from clozemath.errors import ClozeMathError
from clozemath.model.load import load_model
from clozemath.plan import load_config
from clozemath.train.loop import StepMetrics, train

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "experiments" / "smoke.yaml"
TOY = "last_equation"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def last_equation_samples(solution: Solution, method: MethodConfig, rng: random.Random) -> list[Sample]:
    """One sample hiding the members of the solution's last unit of F (none without equations)."""
    if not solution.units:
        return []
    hidden = set(solution.units[-1])
    pieces = [(segment.text, index in hidden) for index, segment in enumerate(solution.shown)]
    return [infilling_sample(solution.problem_id, TOY, solution.prompt, pieces)]


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Objective:
    monkeypatch.setattr(objectives.OBJECTIVES, "_entries", dict(objectives.OBJECTIVES._entries))  # registered for this test only
    return register(Objective(TOY, last_equation_samples))


def toy_config(limit: int) -> ExperimentConfig:
    """The smoke experiment with a method of the toy objective alone, one step of one micro-batch of every sample:
    planned as a config naming it is (the registered name is known to the planner's check)."""
    return load_config(SMOKE, [f"data.limit={limit}", f"train.micro_batch_size={limit}", "train.max_steps=1",
                               "method.name=toy", f"method.objectives=[{TOY}]", "method.attention=prefix_lm"])


def test_a_toy_objective_through_the_registry_alone_is_prepared_and_trained(toy: Objective, tmp_path: Path) -> None:
    config = toy_config(limit=4)
    prepared = prepare_data(config)
    assert [s.kind for s in prepared.samples] == [TOY] * 4  # every GSM8K solution here has equations
    natalia = prepared.samples[0]
    assert natalia.prefix.endswith(
        "Natalia sold 48/2 = 24 clips in May.\nNatalia sold <M_0> clips altogether in April and May.<SEP>"
    )
    assert natalia.target == "<M_0> 48+24 = 72<EOS>"
    assert prepared.summary(config.data.max_length)["samples"] == {TOY: 4}
    assert sys.modules[__name__] in objectives.source_modules()  # a run's preprocessing cache follows its code
    assert lm_repeats(Counter({"lm": 10, TOY: 10}), 0.75) == 3.0  # balanced against LM like every infilling kind

    rows = [row for row in prepared.encoded if row is not None]
    loaded = load_model(config.model, num_sentinels_needed(prepared.samples), "cpu", training=True)
    steps: list[StepMetrics] = []
    checkpoints: list[list[str]] = []

    def report(metrics: StepMetrics, checkpoint: Path | None) -> None:
        steps.append(metrics)
        checkpoints.append(sorted(p.name for p in (checkpoint / "adapter").iterdir()) if checkpoint else [])

    train(loaded.model, rows, config, specials=loaded.specials, pad_id=loaded.tokenizer.pad_token_id, report=report,
          scratch_dir=tmp_path)
    [step] = steps
    assert (step.step, step.total_steps) == (1, 1) and step.loss > 0
    assert step.tokens == sum(len(row["input_ids"]) for row in rows)  # every toy sample went through the step
    assert "adapter_model.safetensors" in checkpoints[0]


def test_a_registered_objective_that_does_not_say_what_it_reads_keys_on_the_whole_method_and_the_seed(
    toy: Objective,
) -> None:
    """The conservative defaults (`Objective.draws`, `Objective.settings`): any setting or seed may reach its
    samples, so any of them tells its preprocessing caches apart."""
    method = toy_config(limit=1).method
    inputs = objectives.sample_inputs(method, 0)
    assert inputs != objectives.sample_inputs(method, 1)
    for change in ({"attention": "causal"}, {"name": "other"}, {"mft": {"r_max": 0.2}}):
        assert objectives.sample_inputs(method.model_validate({**method.model_dump(), **change}), 0) != inputs, change


def test_an_unknown_objective_is_a_one_line_error() -> None:
    method = MethodConfig(name="m").model_copy(update={"objectives": ["lm", "no_such_objective"]})
    with pytest.raises(ClozeMathError, match="unknown objective 'no_such_objective' \\(known: lm, cloze, random_span\\)"):
        objectives.needs_offsets(method)


def test_names_come_without_torch() -> None:
    """A config's objective names are checked (`clozemath.plan`) before anything heavy is imported."""
    code = ("import sys; from clozemath.data.objectives import objective_names; "
            "print(*objective_names(), 'torch' in sys.modules, 'transformers' in sys.modules)")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert out.split() == ["lm", "cloze", "random_span", "False", "False"]
