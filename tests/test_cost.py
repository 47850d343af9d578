"""`clozemath run --dry-run`: a grid's cost estimated before anything starts (clozemath/cost/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clozemath.config import ModelConfig
from clozemath.cost import TrialCost, meta_shape, schedule, training_flops_per_token
from clozemath.data.prepare import prepare_data
from clozemath.plan import load_plan
from clozemath.safe_yaml import read_yaml

ROOT = Path(__file__).resolve().parents[1]
GRID = "configs/grids/smoke.yaml"
NARROW = ["axes.dataset=[gsm8k]", "axes.model=[tiny-llama]"]  # base, mft and clozemath on 8 GSM8K problems


def dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    """`clozemath run ... --dry-run` in a process of its own, which then says whether Ray was imported at all."""
    code = ("import sys; from clozemath_cli import main; code = main(sys.argv[1:]); "
            "print('ray imported:', 'ray' in sys.modules); sys.exit(code)")
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-c", code, "run", *args], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=600)


def test_a_grid_expands_into_its_trials_costs_and_starts_nothing(tmp_path: Path) -> None:
    output = tmp_path / "runs"
    overrides = [*NARROW, f"train.output_dir={output}", f"tracking.uri=sqlite:///{tmp_path / 'm.db'}"]
    done = dry_run(GRID, *overrides, "--dry-run", "--gpus", "2", "--card", "H100", "--details")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    plan = load_plan(ROOT / GRID, overrides)
    # the totals first, what they count, a line per trial named by what varies, all within 120 columns
    assert lines[0].startswith("smoke-grid: 3 trials, ") and lines[0].endswith(
        "of wall time on 1 node of 2 x H100 (an estimate: nothing was started)")
    assert lines[1].startswith("It counts each trial's training")
    brief = lines[: lines.index(next(line for line in lines if line.startswith("| trial | GPUs | samples")))]
    assert max(map(len, brief)) <= 120
    assert [line.split(" | ")[0].strip("| ") for line in brief if line.startswith("| ") and "·" in line] == [
        "base · seed 0", "mft · seed 0", "clozemath · seed 0"]
    assert "Warning" not in done.stderr and done.stderr.splitlines()[0].startswith("[smoke-grid] estimating 3 trial")
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines if line.startswith("| smoke-grid/")}
    assert sorted(rows) == sorted(e.name for e in plan.experiments)  # one line a trial of the expanded grid
    trained = [e for e in plan.experiments if e.method.trains]
    for experiment in trained:  # 8 problems: every sample counted, none estimated
        samples = sum(row is not None for row in prepare_data(experiment).encoded)
        cells = rows[experiment.name]
        assert int(cells[2].replace(",", "")) == samples
        assert int(cells[4].replace(",", "")) == experiment.train.max_steps == 4
        assert cells[6] == "2"  # ZeRO-2 as set
    assert all(rows[e.name][4] == "-" for e in plan.experiments if not e.method.trains)  # base: nothing to train
    assert any("GPU-hours; wall time" in line for line in lines)
    assert any("tokens counted with tiny-llama's tokenizer" in line for line in lines)
    assert any(line.startswith("- training tiny-llama") for line in lines)  # the figure used, and whence
    assert "ray imported: False" in lines
    assert not output.exists() and not (tmp_path / "m.db").exists()  # no run folder, no store


def test_without_a_gpu_the_dry_run_estimates_one_of_the_default_card_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from clozemath_cli import main

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a machine without a GPU, whatever this one has
    assert main(["run", str(ROOT / GRID), *NARROW, f"train.output_dir={tmp_path}", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("on 1 node of 1 x H100 (an estimate: nothing was started)")
    assert lines[1] == ("This machine sees no GPU: estimated for one H100 (--gpus N [--nodes K] [--card NAME] for a "
                        "cluster).")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", "2"], "--gpus is an option of --dry-run, which is not given: nothing was started"),
        (["--card", "H100", "--details"], "--card is an option of --dry-run"),
        (["--nodes", "1"], "--nodes is an option of --dry-run"),
        (["--dry-run", "--gpus", "0"], "--dry-run: --gpus 0 must be a whole number of GPUs, at least 1"),
        (["--dry-run", "--gpus", "1.5"], "--dry-run: --gpus 1.5 must be a whole number of GPUs, at least 1"),
        (["--dry-run", "--gpus", "2", "--nodes", "3"], "--dry-run: --nodes 3 must be between 1 and the GPUs (2)"),
    ],
)
def test_a_dry_runs_flag_without_it_starts_nothing_and_a_bad_one_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    """`--gpus 2` with `--dry-run` forgotten started the whole grid (2026-12-05); `--gpus 0` blamed `--nodes`."""
    from clozemath_cli import main

    assert main(["run", str(ROOT / GRID), *NARROW, f"train.output_dir={tmp_path / 'runs'}", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"clozemath: error: {message}")
    assert not (tmp_path / "runs").exists()


def trial(name: str, gpus: float, seconds: float) -> TrialCost:
    return TrialCost(name, gpus, 0, 0, None, None, train_s=seconds, first_step_s=0.0, eval_s=0.0, fixed_s=0.0)


def test_trials_start_in_order_as_soon_as_their_gpus_are_free() -> None:
    trials = [trial("a", 1, 10), trial("b", 1, 20), trial("c", 1, 30), trial("d", 2, 5)]
    placed = schedule(trials, nodes=1, gpus_per_node=2)
    assert [p.start_s for p in placed] == [0, 0, 10, 40]  # d waits for both GPUs: b ends at 20, c at 40
    assert [p.start_s for p in schedule(trials, nodes=1, gpus_per_node=2, max_concurrent=1)] == [0, 10, 30, 60]
    wide = schedule([trial("a", 1, 10), trial("b", 4, 10)], nodes=2, gpus_per_node=4)
    assert wide[1].start_s == 0 and wide[1].nodes == (1,)  # whole on the node left free
    spread = schedule([trial("a", 1, 10), trial("b", 6, 10)], nodes=2, gpus_per_node=4)
    assert spread[1].start_s == 0 and spread[1].nodes == (0, 1)  # 3 free on node 0 and 4 on node 1


def test_training_flops_count_lora_and_the_output_layer_at_targets_only() -> None:
    model = meta_shape(ModelConfig.model_validate(read_yaml(ROOT / "configs" / "models" / "tiny-llama.yaml")), 1000)
    # tiny-llama: hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 key/value heads; LoRA rank 8; 1,024 rows (untied,
    # each with trainable token rows: the output matrix needs its weight's gradient)
    frozen = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3)
    lora = 2 * 8 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)
    output = 6 * 1024 * 64 * 0.25
    attention = 12 * 2 * 4 * 16 * 10
    assert training_flops_per_token(model, target_share=0.25, context=10) == pytest.approx(
        4 * frozen + 6 * lora + output + attention)


def test_trials_sharing_a_card_take_turns_unless_measured_side_by_side() -> None:
    """A fifth of a card: its share of the card's time (processes take turns on a GPU: a main grid's five
    evaluations on one H100 had returned nothing after 3.5 minutes, where `--dry-run` said 1.7 a trial), or what
    `shared` measured (five eager SmolLM2 trainings on one H100: 12,000 tokens/s each); a quarter, where only five
    were measured: the card's total with five, shared by four (one eager trial alone leaves the card idle between
    its kernels, so its share of the card's time would be far too low)."""
    from clozemath.cost.throughput import Figure, Throughput
    from clozemath.cost.trials import Estimator

    table = Throughput(ROOT / "configs")
    estimator = Estimator(table, table.card("H100"), 1)
    smollm2 = table.model_config("smollm2-135m")
    alone = Figure(18515.0, "alone")
    measured = table.models["smollm2-135m"]["shared"]["H100"]["train_eager"][5]
    assert estimator.shared_rate(smollm2, alone, 0.2, "train_eager") == measured
    assert estimator.shared_rate(smollm2, alone, 0.25, "train_eager") == pytest.approx(5 * measured / 4)
    assert 5 * measured / 4 > 18515.0 / 4
    assert estimator.shared_rate(smollm2, Figure(53.41, "alone"), 0.2, "eval_greedy") == pytest.approx(53.41 / 5)
    assert estimator.shared_rate(smollm2, alone, 2.0, "train_eager") == pytest.approx(2 * 18515.0)
    assert any("a trial of 5 on a card" in what and "measured side by side" in how
               for what, how in estimator.notes.items())


def test_a_gguf_model_is_parsed_once_a_grid_before_its_trials_and_a_model_without_one_never() -> None:
    """The first load of a GGUF model fills the parse cache while the trials that started with it wait: the grid's
    wall time carries one parse per distinct GGUF model, in seconds plus seconds per billion parameters."""
    from clozemath.cost.throughput import Throughput
    from clozemath.cost.trials import Estimator

    table = Throughput(ROOT / "configs")
    estimator = Estimator(table, table.card("H100"), 1)
    smollm2, tiny = table.model_config("smollm2-135m"), table.model_config("tiny-llama")
    entry = table.overhead("gguf_parse")
    params = estimator.shape(smollm2)[0].params
    once = entry["seconds"] + entry["per_billion"] * params / 1e9
    assert estimator.gguf_parse_s([smollm2, smollm2, tiny]) == pytest.approx(once)
    assert estimator.gguf_parse_s([tiny]) == 0.0
    plan_free = dry_run(GRID, *NARROW, "--dry-run", "--gpus", "1", "--card", "H100", "--details")
    assert plan_free.returncode == 0 and "parsed once" not in plan_free.stdout


def test_a_model_shipped_in_chunks_is_estimated_before_its_chunks_are_installed(tmp_path: Path) -> None:
    """No weights needed: with none of Qwen's chunks on the machine, its tokens are counted with the stand-in
    tokenizer (said so) and its shape keeps its own vocabulary; the GGUF parse is still part of the wall time."""
    done = dry_run("configs/grids/replication_qwen1.5b.yaml", "model.gguf_chunks.packages=null",
                   f"model.gguf_chunks.files={tmp_path}/part*.bin", "axes.method=[it]", "axes.train.seed=[0]",
                   "--dry-run", "--gpus", "1", "--card", "H100", "--details")
    assert done.returncode == 0, done.stderr[-2000:]
    brief = " ".join(done.stdout.split("| trial | GPUs | samples")[0].split())  # before the details, wrapped
    assert ("The tokens of qwen2.5-coder-1.5b-instruct are estimated with a stand-in tokenizer (theirs is not on this "
            "machine).") in brief
    assert "tokens estimated with llama-3.2-1b-random's tokenizer (qwen2.5-coder-1.5b-instruct's is not on this " \
           "machine)" in done.stdout
    assert "the GGUF model(s) parsed once" in done.stdout and "ray imported: False" in done.stdout
    from clozemath.cost.throughput import Throughput
    from clozemath.cost.trials import Estimator

    table = Throughput(ROOT / "configs")
    qwen = table.model_config("qwen2.5-coder-1.5b-instruct")
    chunks = qwen.gguf_chunks.model_copy(update={"packages": None, "files": f"{tmp_path}/part*.bin"})
    qwen = qwen.model_copy(update={"gguf_chunks": chunks})
    shape, counting = Estimator(table, table.card("H100"), 1).shape(qwen)
    assert counting.name == "llama-3.2-1b-random"
    assert shape.model.get_base_model().get_input_embeddings().weight.shape[0] >= 151665  # Qwen's, not Llama's 128k


def test_zero3_takes_its_compiled_scaling_where_the_table_has_it_apart() -> None:
    """Compiling gains less under ZeRO-3 (its gathers are not compiled): a compiled ZeRO-3 trial is scaled by
    `zero3_compiled`, an uncompiled one by `zero3`; ZeRO-2 has one figure for both; one worker is never scaled. The
    expected figures are read from a table written here, not from the project's."""
    from clozemath.cost.throughput import Throughput

    table = Throughput(ROOT / "configs")
    table.scaling = {"zero2": {2: 0.97, 4: 0.99}, "zero3": {2: 0.82}, "zero3_compiled": {2: 0.71, 4: 0.64}}
    assert table.scaling_factor(3, 4, compiled=True).value == 0.64
    assert table.scaling_factor(3, 2, compiled=True).value == 0.71
    assert table.scaling_factor(3, 4, compiled=False).value == 0.82  # the nearest listed below 4
    assert table.scaling_factor(2, 4, compiled=True).value == table.scaling_factor(2, 4, compiled=False).value == 0.99
    assert table.scaling_factor(3, 1, compiled=True).value == 1.0


@pytest.mark.slow  # reads SmolLM2's tokenizer from its GGUF file
@pytest.mark.parametrize(("stage", "engine"), [(2, "graphs"), (3, "eager")])
def test_the_matched_grids_estimate_rises_by_its_curve_evaluations(stage: int, engine: str) -> None:
    """replication_matched.yaml evaluates 200 GSM8K test problems greedy at every tenth of the steps on seeds 0-2
    (`eval.every_share: 0.1`): ten evaluations during training, each 200 problems at the rate of the engine its
    worker decodes with (CUDA graphs under ZeRO-2, eager under ZeRO-3) on a fifth of the card (its trials take turns
    on it), where seed 3 and the base model evaluate only after training."""
    from clozemath.cost import estimate
    from clozemath.cost.throughput import Throughput
    from clozemath.cost.trials import Estimator

    narrow = ["axes.method=[mft,base]", "axes.train.seed=[0,3]", f"train.zero_stage={stage}"]
    grid = ROOT / "configs" / "grids" / "replication_matched.yaml"
    with_curves = {s.trial.name: s.trial for s in estimate(load_plan(grid, narrow), 1, "H200").scheduled}
    without = {s.trial.name: s.trial for s in
               estimate(load_plan(grid, [*narrow, "eval.every_share=null"]), 1, "H200").scheduled}
    table = Throughput(ROOT / "configs")
    estimator = Estimator(table, table.card("H200"), 1)
    smollm2 = table.model_config("smollm2-135m")
    greedy = estimator.eval_rate(smollm2, estimator.shape(smollm2)[0], "greedy", engine).value
    length = 256 / 256  # the grid's max_new_tokens over the figures' new tokens
    curve_s = 10 * 200 * length / (greedy * 0.2)
    rises = {name: with_curves[name].eval_s - without[name].eval_s for name in with_curves}
    assert rises == pytest.approx({"replication-matched/method=mft,seed=0": curve_s,
                                   "replication-matched/method=mft,seed=3": 0.0,
                                   "replication-matched/method=base,seed=0": 0.0})
    assert curve_s > 60  # minutes a trial, no rounding error


def test_a_trial_evaluated_in_its_training_worker_is_priced_without_an_actors_start_and_second_load() -> None:
    """`eval.in_worker`: a one-worker trained trial starts its evaluation with the model it trained (the figure
    measured for that), where `eval.in_worker=false`, ZeRO-3 and the base model pay an actor's start and a model load;
    nothing else in the trial's price moves."""
    from clozemath.cost import estimate
    from clozemath.cost.throughput import Throughput

    table = Throughput(ROOT / "configs")
    in_worker, actor = table.overhead("eval_in_worker_start")["seconds"], table.overhead("eval_actor_start")["seconds"]
    grid = ROOT / "configs" / "grids" / "replication_qwen1.5b_rates.yaml"
    narrow = ["axes.method=[mft,base]", "axes.train.lr=[5.0e-5]", "axes.train.seed=[0]"]

    def trials(*more: str) -> dict[str, object]:
        return {s.trial.name.split("/")[1].split(",")[0]: s.trial
                for s in estimate(load_plan(grid, [*narrow, *more]), 1, "H200").scheduled}

    auto, off, zero3 = trials(), trials("eval.in_worker=false"), trials("train.zero_stage=3")
    load_s = off["method=base"].fixed_s - actor  # the base model: an actor's start and one load, nothing else
    assert load_s > 0
    assert auto["method=mft"].fixed_s - off["method=mft"].fixed_s == pytest.approx(in_worker - actor - load_s)
    assert zero3["method=mft"].fixed_s == pytest.approx(off["method=mft"].fixed_s)
    assert auto["method=base"].fixed_s == pytest.approx(off["method=base"].fixed_s)
    assert (auto["method=mft"].train_s, auto["method=mft"].eval_s) == (off["method=mft"].train_s,
                                                                      off["method=mft"].eval_s)


def test_the_estimator_counts_the_evaluations_during_training_that_the_workers_make() -> None:
    """For every trial of every committed grid and runs of several lengths: the dry-run's count of evaluations during
    training and of the problems each decodes equals what the workers' evaluator does (`step_evaluation`, asked at
    every step as `ray_jobs.train` asks it)."""
    from clozemath.cost.trials import curve_evaluations
    from clozemath.eval.during_training import step_evaluation

    evaluated = 0
    for grid in sorted((ROOT / "configs" / "grids").glob("*.yaml")):
        for config in load_plan(grid, []).experiments:
            if not config.method.trains:
                continue
            evaluation = step_evaluation(config)
            for total in (1, 3, 10, 199, 200, 290, 685, 1001):
                worker = (0, 0) if evaluation is None else (
                    sum(evaluation.due(step, total) for step in range(1, total + 1)), len(evaluation.problems))
                assert curve_evaluations(config, total) == worker, (config.name, total)
                evaluated += worker[0] > 1
    assert evaluated  # some grids' trials do evaluate during training


@pytest.mark.parametrize("ids", ["math500", "three"])
@pytest.mark.parametrize("limit", [None, 2, 100, 1000])
def test_the_estimate_prices_the_problems_an_ids_file_lists_then_its_limit_as_the_evaluation_takes_them(
    tmp_path: Path, ids: str, limit: int | None,
) -> None:
    """A set chosen by an ids file (MATH-500, or three ids) with a limit above, within or below the list: the dry-run
    counts the problems the evaluation decodes (`eval_problems`), never the limit where the list is shorter."""
    from clozemath.config import EvalSetConfig
    from clozemath.cost.trials import problems_evaluated
    from clozemath.eval.evaluate import eval_problems

    listing = ROOT / "configs" / "ids" / "math500.txt"
    if ids == "three":
        listing = tmp_path / "three.txt"
        listing.write_text("math-test-4  # a comment\n\nmath-test-0\nmath-test-4999\n")
    set_cfg = EvalSetConfig(dataset="math", split="test", ids=str(listing), limit=limit)
    evaluated = len(eval_problems(set_cfg))
    assert problems_evaluated(set_cfg) == evaluated
    assert evaluated == min(limit or 5000, 500 if ids == "math500" else 3)


@pytest.mark.slow  # ~10 s: the model's shape and the throughput table
def test_the_dry_run_prices_an_ids_list_shorter_than_its_limit_as_the_list() -> None:
    """MATH-500 with `limit: 1000` costs what MATH-500 alone costs, and half what a 1,000-problem MATH test subset
    costs."""
    from clozemath.cost import estimate

    def eval_seconds(*sets: str) -> float:
        overrides = ["method=base", f"eval.sets=[{','.join(sets)}]"]  # nothing to train: evaluation alone
        plan = load_plan(ROOT / "configs" / "experiments" / "smoke.yaml", overrides)
        (trial,) = [s.trial for s in estimate(plan, 1, "H200").scheduled]
        return trial.eval_s

    math500 = ROOT / "configs" / "ids" / "math500.txt"
    listed = eval_seconds(f"{{dataset: math, ids: {math500}}}")
    assert eval_seconds(f"{{dataset: math, ids: {math500}, limit: 1000}}") == pytest.approx(listed)
    assert eval_seconds("{dataset: math, limit: 1000}") == pytest.approx(2 * listed)


SAMPLE_LENGTHS = [48 + (97 * k) % 400 for k in range(1500)]
"""One worker's samples in the layout parity test (every worker gets the same: the ranks' agreement is then any
one rank's choice, which a test in one process can make)."""


def test_the_estimator_lays_out_every_trial_as_the_workers_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """For every trial that trains in every committed grid, on an H200 (its share of one): the ZeRO stage, whether it
    packs, the row width, compilation and the steps that the dry-run decides (`Estimator.shaped`) equal what the
    workers' code decides (`resolved_zero_stage`, then `training_layout`) from the same inputs: the model's shape on
    the meta device, the card's bytes less what that model holds, and each worker's samples."""
    from types import SimpleNamespace

    import torch

    from clozemath.cost.shapes import Shape
    from clozemath.cost.throughput import Throughput
    from clozemath.cost.trials import DataCount, Estimator
    from clozemath.train import layout, zero

    table = Throughput(ROOT / "configs")
    card = table.card("H200")
    estimator = Estimator(table, card, 1)
    shapes: dict[str, Shape] = {}
    monkeypatch.setattr(layout, "all_ranks_reduce", lambda value, op, device: value)  # every rank chose alike
    monkeypatch.setattr(layout, "card_bytes", lambda device, share: int(card.memory_bytes * share))
    seen: set[str] = set()
    for grid in sorted((ROOT / "configs" / "grids").glob("*.yaml")):
        for config in load_plan(grid, []).experiments:
            key = json.dumps([config.model.name, config.data.max_length, config.train.model_dump(
                mode="json", exclude={"seed", "lr", "output_dir", "storage"})], sort_keys=True)
            if not config.method.trains or key in seen:
                continue
            seen.add(key)
            name = table.shape_of(config.model).name
            if name not in shapes:
                model = meta_shape(table.shape_of(config.model), 50_000)
                shapes[name] = Shape(model, sum({id(p): p.numel() for p in model.parameters()}.values()), "")
            shape, workers = shapes[name], config.train.num_workers
            lengths = [length for length in SAMPLE_LENGTHS for _ in range(workers)]  # each worker's: SAMPLE_LENGTHS
            data = DataCount(len(lengths), sum(lengths), lengths, 1.0, 0.5, 200.0, "")
            estimated = estimator.shaped(config, shape, data)

            held = sum({id(p): p.numel() * p.element_size() for p in shape.model.parameters()}.values())
            monkeypatch.setattr(layout, "usable_bytes", lambda device, held=held, config=config: int(
                card.memory_bytes * config.train.gpu_share) - held)
            ranks = SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda workers=workers: workers,
                                    get_rank=lambda: 0, ReduceOp=torch.distributed.ReduceOp)
            monkeypatch.setattr(layout, "dist", ranks)
            monkeypatch.setattr(zero, "dist", SimpleNamespace(**vars(ranks), all_reduce=lambda tensor, op: None))
            resolved = layout.resolved_zero_stage(config, shape.model, torch.device("cpu"))  # the card: `card_bytes`
            worker = layout.training_layout(resolved, shape.model, SAMPLE_LENGTHS, torch.device("cuda"))
            assert estimated == (resolved.train.zero_stage, worker), config.name
            assert (worker.row_tokens is not None) == layout.packs(config.train, gpu=True)
    assert len(seen) > 5
