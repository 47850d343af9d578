"""The grid format (axes of values or of bundles, `exclude`, conditional `overrides`, `axes.*` from the command line),
the paper's and the smoke grid as they expand, and grids refused before anything starts (no Ray)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clozemath_cli import main
from clozemath.config import GridConfig
from clozemath.errors import ClozeMathError
from clozemath.plan import as_grid, expand_grid, load_config

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "configs" / "grids" / "paper.yaml"
SMOKE = ROOT / "configs" / "grids" / "smoke.yaml"
ABLATIONS = {"it", "it_prefixlm", "clozemath_causal", "random_span"}


def expanded(path: Path, *overrides: str) -> list:
    grid = load_config(path, list(overrides))
    assert isinstance(grid, GridConfig)
    return expand_grid(grid, ROOT / "configs", path)


def test_paper_grid_is_the_papers_experiments() -> None:
    trials = expanded(PAPER)
    by_name = {t.name: t for t in trials}
    assert len(by_name) == len(trials) == 4 * (2 + 6 + 6) + 4 * 3  # base x 2 sets, mft/clozemath x 2 sets x 3 seeds
    models = {t.model.name: t.model.path for t in trials}
    assert models == {
        "deepseek-math-7b": "deepseek-ai/deepseek-math-7b-base", "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
        "llama-3.2-3b": "meta-llama/Llama-3.2-3B", "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    }
    assert {t.method.name for t in trials} == {"base", "mft", "clozemath"} | ABLATIONS
    for t in trials:
        assert t.model.lora.rank == 32 and t.train.lr == 5e-5 and t.eval.num_beams == 5 and t.eval.cot_k == 9
        assert t.eval.every_steps == (200 if t.data.dataset == "gsm8k" else None)  # Figure 3 plots GSM8K runs only
        assert t.data.seed == t.train.seed and t.train.budget == "epochs"
        sets = {s.dataset: t.eval.decodings_of(s) for s in t.eval.sets}
        if t.method.name == "base":
            assert t.train.seed == 0 and list(sets) == [t.data.dataset]
        elif t.method.name in ABLATIONS:
            assert (t.model.name, t.data.dataset) == ("deepseek-math-7b", "gsm8k") and sets == {"gsm8k": ["beam"]}
        else:
            symbolic = {"gsm_symbolic": ["beam"], "gsm_p1": ["beam"], "gsm_p2": ["beam"]}
            first = {"gsm8k": ["beam", "cot"]} if t.data.dataset == "gsm8k" else {"math": ["beam"]}
            assert sets == first | symbolic
            assert [s.limit for s in t.eval.sets[1:]] == [2000, 2000, 1000]
        if t.method.name == "mft":
            expected = (0.4, "random") if t.data.dataset == "gsm8k" else (0.2, "mask")
            assert (t.method.mft.r_max, t.method.mft.noise) == expected
    assert by_name["paper/model=llama-3.2-1b,method=clozemath,dataset=math,seed=2"].data.max_length == 1536


def test_the_data_seed_follows_the_training_seed_unless_set() -> None:
    trials = expanded(SMOKE, "axes.method=[clozemath]", "axes.dataset=[gsm8k]", "axes.train.seed=[3,4]")
    assert sorted((t.train.seed, t.data.seed) for t in trials if t.model.name == "tiny-llama") == [(3, 3), (4, 4)]
    fixed = expanded(SMOKE, "axes.method=[clozemath]", "axes.dataset=[gsm8k]", "axes.train.seed=[3,4]", "data.seed=7")
    assert {t.data.seed for t in fixed} == {7}


def test_smoke_grid_has_the_papers_shape() -> None:
    trials = expanded(SMOKE)
    assert len(trials) == 2 * 3 * 2
    assert {t.model.name for t in trials} == {"tiny-llama", "tiny-llama-b"}
    mft_math = [t for t in trials if t.method.name == "mft" and t.data.dataset == "math"]
    assert {(t.method.mft.r_max, t.method.mft.noise) for t in mft_math} == {(0.2, "mask")}
    assert all(t.tracking.experiment == "smoke-grid" for t in trials)


def test_command_line_narrows_axes_and_sets_the_base() -> None:
    trials = expanded(SMOKE, "axes.method=[base,clozemath]", "axes.dataset=[gsm8k]", "axes.train.seed=[3,4]",
                      "train.max_steps=2", "tracking.experiment=other")
    assert [t.name for t in trials] == [
        f"smoke-grid/model={m},method={k},dataset=gsm8k,seed={s}"
        for m in ("tiny-llama", "tiny-llama-b") for k in ("base", "clozemath") for s in (3, 4)
    ]
    assert all(t.train.max_steps == 2 and t.tracking.experiment == "other" for t in trials)
    # a rule naming a value the command line narrowed away (mft) is no error


def test_a_command_line_override_outlasts_the_axes_and_rules_that_would_undo_it(tmp_path: Path) -> None:
    """`model.lora.rank=16` under a model axis (each value names a whole model) and `train.lr` under a rule that sets
    it for one method: every trial takes the command line's value (both were silently dropped, 2026-12-05); a key an
    axis varies is refused, naming the axis."""
    trials = expanded(SMOKE, "axes.dataset=[gsm8k]", "axes.method=[clozemath]", "model.lora.rank=16")
    assert {t.model.name for t in trials} == {"tiny-llama", "tiny-llama-b"}
    assert {t.model.lora.rank for t in trials} == {16}
    grid = tmp_path / "g.yaml"
    grid.write_text("name: g\nbase: {experiment: smoke}\naxes:\n  method: [it, mft]\n"
                    "overrides:\n  - when: {method: mft}\n    set: {train.lr: 0.5, method.mft.r_max: 0.1}\n")
    it, mft = expanded(grid, "train.lr=0.25", "method.mft.r_max=0.3")
    assert (it.train.lr, mft.train.lr, mft.method.mft.r_max) == (0.25, 0.25, 0.3)
    it, mft = expanded(grid, "train.max_steps=3")  # no axis or rule sets it: the base's, and no rule added
    assert (it.train.max_steps, mft.train.lr) == (3, 0.5)
    assert len(load_config(grid, ["train.max_steps=3"]).overrides) == 1
    for override in ("method=clozemath", "method={name: mft}"):
        with pytest.raises(ClozeMathError, match=r"override 'method': the grid's axis 'method' sets it for each trial"):
            expanded(grid, override)
    with pytest.raises(ClozeMathError, match=r"override 'data': the grid's axis 'dataset' sets it"):
        expanded(SMOKE, "data={dataset: gsm8k}")


def test_an_override_below_one_made_a_rule_keeps_its_place_after_it(tmp_path: Path) -> None:
    """`model=NAME` in a grid with a rule under `model` becomes the grid's last rule; the overrides under it that
    followed on the command line (`model.lora.rank=...`) were applied to the base before it and lost (2026-12-05)."""
    grid = tmp_path / "g.yaml"
    grid.write_text("name: g\nbase: {experiment: smoke}\naxes:\n  method: [it, mft]\n"
                    "overrides:\n  - when: {method: mft}\n    set: {model.lora.dropout: 0.1}\n")
    it, mft = expanded(grid, "model=tiny-llama-b", "model.lora.rank=16", "train.max_steps=3")
    assert {t.model.name for t in (it, mft)} == {"tiny-llama-b"}
    assert (it.model.lora.rank, mft.model.lora.rank, it.train.max_steps) == (16, 16, 3)
    named = expanded(grid, "model=tiny-llama-b")[0].model.lora.rank
    assert named != 16
    it, mft = expanded(grid, "model.lora.rank=16", "model=tiny-llama-b")  # written before it: the model's own rank
    assert (it.model.lora.rank, mft.model.lora.rank) == (named, named)


def test_rules_apply_in_order_and_do_not_leak_between_points(tmp_path: Path) -> None:
    grid = tmp_path / "g.yaml"
    grid.write_text(
        "name: g\nbase: {experiment: smoke}\n"
        "axes:\n  method: [it, mft]\n"
        "  data:\n    small: {data.limit: 4}\n    big: {data.limit: 8, train.max_steps: 3}\n"
        "exclude: [{method: it, data: big}]\n"
        "overrides:\n  - when: {method: mft}\n    set: {train.lr: 0.5, method.mft.r_max: 0.1}\n"
    )
    trials = {t.name: t for t in expand_grid(load_config(grid), ROOT / "configs", grid)}
    assert list(trials) == ["g/method=it,data=small", "g/method=mft,data=small", "g/method=mft,data=big"]
    it, mft_small, mft_big = trials.values()
    assert (it.train.lr, it.data.limit, it.train.max_steps) == (1e-2, 4, 8)  # the base's, untouched by other points
    assert (mft_small.train.lr, mft_small.method.mft.r_max, mft_small.train.max_steps) == (0.5, 0.1, 8)
    assert (mft_big.data.limit, mft_big.train.max_steps) == (8, 3)


def test_a_single_experiment_is_a_grid_of_one() -> None:
    experiment = load_config(ROOT / "configs" / "experiments" / "smoke.yaml")
    (only,) = expand_grid(as_grid(experiment))
    assert only == experiment


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("axes: {model: [tiny-llama, no-such-model]}", "unknown model 'no-such-model'"),
        ("axes: {method: [clozemath, clozemath_v2]}", "unknown method 'clozemath_v2'"),
        ("axes: {model: []}", "axis 'model' has no values"),
        ("axes: {data: {small: 4}}", "axis 'data', bundle 'small': expected a mapping"),
        ("axes: {method: [it]}\nexclude: [{methd: it}]", "exclude[0]: unknown axis 'methd'"),
        ("axes: {method: [it]}\noverrides: [{when: {method: mft}, set: {train.lr: 1}}]",
         "overrides[0].when: axis 'method' has no value 'mft'"),
        ("axes: {method: [it]}\nexclude: [{method: it}]", "`exclude` leaves no point"),
        ("axes: {train.lr: [x]}", "'train.lr'"),
        ("axes: {tracking.experiment: [a, b]}", "must share one `tracking`"),
    ],
)
def test_bad_grids_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    grid = tmp_path / "bad.yaml"
    grid.write_text(f"name: bad\nbase: {{experiment: smoke}}\n{text}\n")
    with pytest.raises(ClozeMathError, match="^" + str(grid).replace(".", r"\.")) as raised:
        load_config(grid)
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("override", "culprit"),
    [
        ("axes.model=[tiny-llama,tiny-gpt]", "unknown model 'tiny-gpt'"),
        ("axes.method=[mft,cloze]", "unknown method 'cloze'"),
        ("axes.dataset=[gsm8k,svamp]", "no bundle 'svamp'"),
        ("axes.optimizer=[adam]", "no such axis"),
    ],
)
def test_clozemath_run_refuses_a_bad_grid_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, culprit: str
) -> None:
    store = [f"train.output_dir={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path / 'm.db'}"]
    argv = ["run", str(SMOKE), override, *store]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("clozemath: error: ") and culprit in err, err
    assert list(tmp_path.iterdir()) == []  # no run folder, no MLflow store


# --- nonsense values and unusable outputs: one line, at once, before Ray or torch is even imported ------------------

BAD_VALUES = [
    ("train.micro_batch_size=0", "'train.micro_batch_size': Input should be greater than or equal to 1"),
    ("train.micro_batch_size=-1", "'train.micro_batch_size': Input should be greater than or equal to 1"),
    ("train.checkpoint_every=0", "'train.checkpoint_every': Input should be greater than or equal to 1"),
    ("train.grad_accum=0", "'train.grad_accum'"),
    ("train.num_workers=0", "'train.num_workers'"),
    ("train.lr=nan", "'train.lr': Input should be a finite number"),
    ("train.lr=-1e-4", "'train.lr': Input should be greater than 0"),
    ("train.lr=inf", "'train.lr': Input should be a finite number"),
    ("train.warmup_ratio=1.5", "'train.warmup_ratio': Input should be less than or equal to 1"),
    ("train.epochs=0", "'train.epochs'"),
    ("eval.num_beams=0", "'eval.num_beams'"),
    ("eval.max_new_tokens=0", "'eval.max_new_tokens'"),
    ("data.max_length=0", "'data.max_length'"),
    ("max_concurrent_trials=0", "'max_concurrent_trials'"),
    ("tracking.uri=foo://bar", "'tracking.uri': unknown scheme 'foo'"),
]


@pytest.mark.parametrize(("override", "message"), BAD_VALUES)
def test_nonsense_values_are_refused_at_load_naming_key_and_file(override: str, message: str) -> None:
    with pytest.raises(ClozeMathError) as raised:
        load_config(SMOKE, [override])
    assert str(raised.value).startswith(str(SMOKE)) and message in str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["method=mft", "method.mft.r_max=1.5"], "'method.mft.r_max': Input should be less than or equal to 1"),
        (["model.lora.dropout=2"], "'model.lora.dropout': Input should be less than 1"),
        (["model.lora.rank=0"], "'model.lora.rank'"),
        (["method.objectives=[lm,nope]"], "'method.objectives.1': unknown objective 'nope' (known: lm, cloze, random_span)"),
        (["eval.decodings=[greedy,nope]"], "'eval.decodings.1': unknown decoding 'nope' (known: greedy, beam, cot)"),
    ],
)
def test_nonsense_values_of_an_experiment_are_refused(overrides: list[str], message: str) -> None:
    experiment = ROOT / "configs" / "experiments" / "smoke.yaml"
    with pytest.raises(ClozeMathError, match=re.escape(message)):
        load_config(experiment, overrides)


def _run_without_heavy_imports(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`clozemath` in a fresh interpreter that reports, after the command, whether Ray, torch or transformers came."""
    script = (
        "import sys; from clozemath_cli import main; code = main(sys.argv[1:]); "
        "print(sorted(m for m in ('ray', 'torch', 'transformers', 'mlflow') if m in sys.modules)); sys.exit(code)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", script, *argv], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lrr=1", "unknown key 'train.lrr'"),
        ("train.micro_batch_size=0", "'train.micro_batch_size'"),
        ("train.output_dir=a_file/runs", "train.output_dir: cannot make the folder 'a_file/runs': "),
        ("tracking.uri=sqlite:///a_file/m.db", "tracking.uri 'sqlite:///a_file/m.db': cannot make the folder"),
        ("tracking.artifact_location=a_file/art", "tracking.artifact_location 'a_file/art': cannot make"),
    ],
)
def test_clozemath_run_reports_a_mistake_in_a_second_without_importing_ray(
    tmp_path: Path, override: str, message: str
) -> None:
    (tmp_path / "a_file").write_text("not a folder")
    started = time.perf_counter()
    done = _run_without_heavy_imports(["run", str(SMOKE), override], tmp_path)
    assert time.perf_counter() - started < 10  # was 11-16 s; about 1 s on a quiet machine
    assert done.returncode == 2 and done.stdout == "[]\n", (done.stdout, done.stderr)
    assert done.stderr.startswith("clozemath: error: ") and message in done.stderr and done.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_replication_grids_tune_on_train_and_test_on_test() -> None:
    from clozemath.data.sources import load_problems
    from clozemath.eval.evaluate import eval_problems

    selection = expanded(ROOT / "configs" / "grids" / "replication_lr.yaml")
    assert {(t.method.name, t.train.lr) for t in selection} == {
        (method, lr) for method in ("it", "mft", "clozemath") for lr in (1e-4, 3e-4, 1e-3)
    }
    trial = selection[0]
    trained = {p.id for p in load_problems(trial.data.dataset, trial.data.split)}
    validation = [p.id for set_cfg in trial.eval.sets for p in eval_problems(set_cfg)]
    assert len(validation) == 500 and trained.isdisjoint(validation)
    assert all(p.startswith("gsm8k-train-") for p in validation)

    final = expanded(ROOT / "configs" / "grids" / "replication.yaml")
    assert sorted((t.method.name, t.train.seed) for t in final) == sorted(
        [("base", 0)] + [(m, s) for m in ("it", "mft", "clozemath") for s in (0, 1, 2)]
    )
    for t in final:
        assert t.data.split == "train" and t.data.limit is None  # the whole train set
        assert [s.split for s in t.eval.sets] == ["test"] * 4
        assert t.eval.sets[0].dataset == "gsm8k" and t.eval.sets[0].limit is None  # all 1,319 problems
    base = next(t for t in final if t.method.name == "base")
    assert base.eval.decodings == ["greedy"] and base.eval.every_steps is None


@pytest.mark.parametrize(("gpus", "workers", "share", "expected"), [(1, 1, 1.0, 1), (1, 1, 0.25, 4), (2, 1, 0.25, 8),
                                                                     (2, 2, 0.5, 2), (4, 2, 1.0, 2)])
def test_trials_at_once_count_each_workers_share_of_a_gpu(monkeypatch, gpus, workers, share, expected) -> None:
    import ray

    from ray_jobs import eval_job, grid

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": gpus, "CPU": 16})
    trials = expanded(SMOKE, "axes.model=[tiny-llama]", "axes.method=[mft]", "axes.dataset=[gsm8k]",
                      f"train.num_workers={workers}", f"train.gpu_share={share}")
    plain = GridConfig.model_validate({"name": "g", "base": {}})
    assert grid.concurrent_trials(plain, trials) == expected
    pool = eval_job._actor_pool(trials[0], None)
    assert pool["num_gpus"] == share and pool["compute"].max_size == round(gpus / share)


def test_a_failed_trials_line_is_the_raised_error_not_rays_advice() -> None:
    from ray_jobs.grid import user_error_line

    text = (
        "ray.exceptions.RayTaskError(OutOfMemoryError): ray::MapBatches(Evaluator)() (pid=7, ip=10.0.0.1)\n"
        '  File "/x/decode.py", line 3, in decode\n'
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n\n"
        "To change retry attempts, backoff, or which errors are retried, configure "
        "`ray.data.DataContext.get_current()` if you believe this to be transient."
    )
    assert user_error_line(RuntimeError(text)) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert user_error_line(RuntimeError("no exception line here\nonly words")) == "only words"


LR_GRID = """
name: rates
require_method_lr: true
base: {model: tiny-llama, method: it}
axes:
  method: [base, it, clozemath]
  train.seed: [0, 1]
overrides:
  - when: {method: it}
    set: {train.lr: 3.0e-4}
  - when: {method: clozemath, train.seed: 0}
    set: {train.lr: 1.0e-3}
"""


def test_a_grid_that_requires_each_methods_rate_refuses_a_method_without_one(tmp_path: Path, capsys) -> None:
    """ClozeMath seed 1 has no rate of its own (its rule covers seed 0 only): refused, naming the point; base trains
    nothing and needs none; with the rule widened, or the rate on an axis, every point expands."""
    grids = tmp_path / "configs" / "grids"
    grids.mkdir(parents=True)
    for kind in ("models", "methods"):
        (tmp_path / "configs" / kind).symlink_to(ROOT / "configs" / kind)
    path = grids / "rates.yaml"
    path.write_text(LR_GRID)
    with pytest.raises(ClozeMathError, match=r"rates\.yaml \(point method=clozemath,seed=1\): method 'clozemath' has no "
                                             r"learning rate of its own \(the grid sets require_method_lr\)"):
        load_config(path)
    path.write_text(LR_GRID.replace("{method: clozemath, train.seed: 0}", "{method: clozemath}"))
    rates = {(t.method.name, t.train.seed): t.train.lr for t in expanded(path)}
    assert rates == {("base", 0): 5e-5, ("base", 1): 5e-5, ("it", 0): 3e-4, ("it", 1): 3e-4,
                     ("clozemath", 0): 1e-3, ("clozemath", 1): 1e-3}
    # one rate for every method from the command line: refused in one line (it would replace the grid's own)
    assert main(["run", str(path), "axes.method=[it,clozemath,mft]", "train.lr=1e-4"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("override 'train.lr': the grid gives each method its own rate (require_method_lr): change "
                         "them in its `overrides`, or narrow a rate axis")
    # a method added on the command line without a rate of its own: refused in one line
    assert main(["run", str(path), "axes.method=[it,clozemath,mft]"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("(point method=mft,seed=0): method 'mft' has no learning rate of its own (the grid sets "
                         "require_method_lr): give it one in `overrides` (when: {method: ...}, set: {train.lr: ...})")
    path.write_text(LR_GRID.split("overrides:")[0].replace("train.seed: [0, 1]", "train.lr: [1.0e-4, 1.0e-3]"))
    assert sorted(t.train.lr for t in expanded(path) if t.method.trains) == [1e-4, 1e-4, 1e-3, 1e-3]  # a rate axis
