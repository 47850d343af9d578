"""Faults of the machine and of the run's own files, tried as a careless user and a failing machine would (issue 50):
edited data, a damaged run record or checkpoint, a removed lock file, signals as schedulers send them, a tracking
store that hangs or is busy, storage that fails. Each case ends in a result or one line naming the culprit and the
way out, nothing finished is lost, and nothing stale is taken for a result.

Like tests/test_hostile.py (whose helpers these reuse), the costly cases run the command as a user would: the CLI in a
process of its own (`cli`), within its bounds; the cheap refusals run `main` in this process (`refused`)."""

from __future__ import annotations

import json
import os
import shutil
import shlex
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import psutil
import pytest

from clozemath import interrupts
from clozemath.errors import ClozeMathError
from clozemath.plan import load_config, load_plan, run_inputs, with_absolute_paths
from clozemath.records import RUN_LOCK, RUN_RECORD, RunInputs, claim_run_folder, run_lock
from conftest import LEARNS, ROOT, SMOKE, ended, run_command, start_command
from test_hostile import SECONDS, TRAINING_STEP, _holder, outputs, refused

GSM8K_TRAIN = Path(os.environ["CLOZEMATH_DATA_DIR"]) / "gsm8k" / "train.jsonl"


def _training_file(tmp_path: Path, problems: int = 16) -> Path:
    """A training file of its own (the first GSM8K problems), to edit."""
    path = tmp_path / "data" / "train.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with GSM8K_TRAIN.open() as lines:
        path.write_text("".join(next(lines) for _ in range(problems)))
    return path


# --------------------------------------------------------------------------------------------------------------
# A run's identity: its settings, the data it reads, the code that makes its samples


def test_a_run_folder_refuses_edited_data_naming_it_and_the_way_out(tmp_path: Path) -> None:
    data = _training_file(tmp_path)
    experiments = load_plan(ROOT / SMOKE, [*outputs(tmp_path), f"data.path={data}"]).experiments
    folder = tmp_path / "runs" / "smoke"
    claim_run_folder(folder, experiments, run_inputs(experiments))
    (folder / "adapter").mkdir()
    claim_run_folder(folder, experiments, run_inputs(experiments))  # the same data: a resume
    data.write_text(data.read_text().replace("Natalia", "Natasha"))
    with pytest.raises(ClozeMathError, match=rf"{folder} holds a run made from other inputs \(training set "
                       rf"gsm8k/train at {data}: its data changed\): it is left as it is; give this one a folder of its "
                       r"own with name=<new name>"):
        claim_run_folder(folder, experiments, run_inputs(experiments))


def test_a_run_recorded_before_a_field_was_added_is_still_its_run_but_a_change_inside_a_list_is_not(
    tmp_path: Path
) -> None:
    """A newer clozemath gave evaluation sets `ids` (off: None): a folder recorded before (its `eval.sets` written
    without it) resumes; a setting changed inside that list is still another config."""
    experiments = load_plan(ROOT / SMOKE, outputs(tmp_path)).experiments
    folder = tmp_path / "runs" / "smoke"
    claim_run_folder(folder, experiments, run_inputs(experiments))
    (folder / "adapter").mkdir()
    record = json.loads((folder / RUN_RECORD).read_text())
    (settings,) = record["settings"].values()
    assert "'ids': None" in settings["eval.sets"]
    settings["eval.sets"] = settings["eval.sets"].replace("'ids': None, ", "")  # as the older clozemath wrote it
    (folder / RUN_RECORD).write_text(json.dumps(record))
    claim_run_folder(folder, experiments, run_inputs(experiments))  # a resume
    changed = load_plan(ROOT / SMOKE, [*outputs(tmp_path), "eval.sets=[{dataset: gsm8k, limit: 5}]"]).experiments
    with pytest.raises(ClozeMathError, match=r"holds the run of another config \(eval.sets: "):
        claim_run_folder(folder, changed, run_inputs(changed))


def test_a_run_folder_refuses_changed_sample_code_naming_the_module(tmp_path: Path) -> None:
    experiments = load_plan(ROOT / SMOKE, outputs(tmp_path)).experiments
    inputs = run_inputs(experiments)
    assert "clozemath.data.segment" in inputs.code and any(name.startswith("training set") for name in inputs.data)
    folder = tmp_path / "runs" / "smoke"
    claim_run_folder(folder, experiments, inputs)
    (folder / "ray").mkdir()
    edited = RunInputs(inputs.data, {**inputs.code, "clozemath.data.segment": "0" * 16})
    with pytest.raises(ClozeMathError, match=r"the code that makes the training samples changed "
                       r"\(clozemath.data.segment\)"):
        claim_run_folder(folder, experiments, edited)


def test_a_run_folder_is_one_folder_however_its_paths_are_spelled(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`./runs` and its absolute path, a relative and an absolute SQLite store: the same run (a record from before
    paths were resolved holds them as written)."""
    monkeypatch.chdir(tmp_path)
    relative = load_plan(ROOT / SMOKE, ["train.output_dir=./runs", "tracking.uri=sqlite:///mlruns.db"]).experiments
    absolute = load_plan(ROOT / SMOKE, outputs(tmp_path)).experiments
    inputs = run_inputs(absolute)
    assert inputs == run_inputs(relative)
    folder = tmp_path / "runs" / "smoke"
    claim_run_folder(folder, relative, inputs)
    (folder / "adapter").mkdir()
    claim_run_folder(folder, absolute, inputs)
    claim_run_folder(folder, [with_absolute_paths(e) for e in relative], inputs)


@pytest.mark.parametrize("damage, problem", [
    (lambda file: file.write_text("{not json"), "not JSON"),
    (lambda file: file.write_text("[1, 2]"), "not a run record"),
    (lambda file: file.write_text('{"settings": {"smoke": 3}}'), "not a run record"),
    (lambda file: file.write_bytes(b"\xff\xfe\x00"), "not text"),
    (lambda file: file.mkdir(), "a folder, not a file"),
], ids=["garbage", "a-list", "wrong-shape", "binary", "a-folder"])
def test_a_damaged_run_record_is_one_line_naming_it_and_the_way_out(tmp_path: Path, capsys, damage,
                                                                    problem: str) -> None:
    folder = tmp_path / "runs" / "smoke"
    (folder / "adapter").mkdir(parents=True)
    damage(folder / RUN_RECORD)
    error = refused(capsys, "run", str(ROOT / SMOKE), *outputs(tmp_path))
    assert f"{folder / RUN_RECORD}: damaged ({problem})" in error
    assert f"remove {folder / RUN_RECORD} and run again" in error and "name=<new name>" in error


def test_a_damaged_run_record_in_a_folder_without_work_is_recorded_afresh(tmp_path: Path) -> None:
    experiments = load_plan(ROOT / SMOKE, outputs(tmp_path)).experiments
    folder = tmp_path / "runs" / "smoke"
    folder.mkdir(parents=True)
    (folder / RUN_RECORD).write_text("[]")
    claim_run_folder(folder, experiments, RunInputs({}, {}))
    assert json.loads((folder / RUN_RECORD).read_text())["settings"].keys() == {"smoke"}


def test_removing_the_lock_file_of_a_live_run_lets_no_second_run_in(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "runs" / "smoke"
    holder = _holder(folder)
    try:
        (folder / RUN_LOCK).unlink()
        error = refused(capsys, "run", str(ROOT / SMOKE), *outputs(tmp_path))
        assert f"{folder}: another run is live in this folder" in error
        (folder / RUN_LOCK).write_text("garbage\n" * 10_000)
        error = refused(capsys, "run", str(ROOT / SMOKE), *outputs(tmp_path))
        assert "(another process)" in error
    finally:
        holder.kill()
        holder.wait()
    with run_lock(folder):
        assert (folder / RUN_LOCK).read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"


def test_a_folder_in_place_of_the_lock_file_is_one_line_naming_it(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "runs" / "smoke"
    (folder / RUN_LOCK).mkdir(parents=True)
    error = refused(capsys, "run", str(ROOT / SMOKE), *outputs(tmp_path))
    assert f"{folder / RUN_LOCK}: cannot be written" in error and "remove it and run again" in error


def _tensors(adapter: Path) -> dict[str, "torch.Tensor"]:
    from safetensors.torch import load_file

    return load_file(adapter / "adapter_model.safetensors")


def _files(folder: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.slow
def test_a_run_after_its_training_data_changed_never_resumes_the_old_checkpoints(tmp_path: Path) -> None:
    """The bug of issue 50: the same config after its training file changed reported the old adapter without
    training (Ray Train's run name held the config only). Its folder refuses it in one line; with the folder gone
    and its checkpoints elsewhere (`train.storage`), the run trains on the new data from step 1."""
    from conftest import run_smoke

    from clozemath import tracking

    data = _training_file(tmp_path)
    storage = tmp_path / "checkpoints"
    args = [f"data.path={data}", f"train.storage={storage}", "eval.sets=[]"]  # what trains is the test
    code, lines = run_smoke(tmp_path, *args)
    assert code == 0, "\n".join(lines[-30:])
    folder = tmp_path / "runs" / "smoke"
    first = _tensors(folder / "adapter")
    data.write_text(data.read_text().replace("Natalia", "Natasha").replace("48", "49"))
    code, lines = run_smoke(tmp_path, *args)
    assert code == 2 and lines[-1].startswith(f"clozemath: error: {folder} holds a run made from other inputs "
                                              f"(training set gsm8k/train at {data}: its data changed)"), lines[-5:]
    assert "name=<new name>" in lines[-1] and not any("Traceback" in line for line in lines)
    assert _tensors(folder / "adapter").keys() == first.keys()  # left as it was
    for name, tensor in _tensors(folder / "adapter").items():
        assert tensor.equal(first[name]), name
    os.rename(folder, tmp_path / "old-run")  # the folder moved away; its checkpoints stay under train.storage
    code, lines = run_smoke(tmp_path, *args)
    assert code == 0, "\n".join(lines[-30:])
    assert any("training 8/8" in line for line in lines), lines
    store = load_plan(ROOT / SMOKE, outputs(tmp_path)).experiments[0].tracking
    newest = tracking.find_runs(store, {"role": "trial"})[0]
    losses = tracking.client(store.uri).get_metric_history(newest.info.run_id, "train/loss")
    assert sorted(metric.step for metric in losses) == list(range(1, 9))  # trained from step 1
    second = _tensors(folder / "adapter")
    assert second.keys() == first.keys() and any(not second[name].equal(first[name]) for name in first)


@pytest.mark.slow
def test_eval_of_a_run_writes_a_folder_of_its_own_and_leaves_the_run_as_it_was(smoke_run) -> None:
    """The README's `clozemath eval CONFIG` of a trained run (its adapter): the run's folder byte for byte as it
    was; the predictions in `evals/` beside it."""
    from conftest import SMOKE_RUN

    runs = smoke_run.folder / "runs"
    before = _files(runs / "smoke")
    assert before
    store = [f"train.output_dir={runs}", f"tracking.uri=sqlite:///{smoke_run.folder / 'mlruns.db'}"]
    code, console = run_command(["eval", SMOKE, *store, *SMOKE_RUN], 480, runs)
    assert code == 0, console[-3000:]
    assert _files(runs / "smoke") == before
    (evaluation,) = (runs / "evals").iterdir()
    assert evaluation.name.startswith("smoke-")
    rows = (evaluation / "eval" / "predictions" / "gsm8k.jsonl").read_text().splitlines()
    assert len(rows) == 4 and str(evaluation / "eval" / "predictions") in console


# --------------------------------------------------------------------------------------------------------------
# Checkpoints that survive a bad write


def _checkpoint(run: Path, name: str, step: int, ranks: int = 2) -> Path:
    """A checkpoint as the workers leave it: each rank's files and its mark, in one folder."""
    from clozemath.train.checkpoint import mark_complete

    folder = run / name
    for rank in range(ranks):
        part = run / f".rank{rank}-{name}"  # each rank writes its part in a folder of its own, then Ray copies it
        (part / "state").mkdir(parents=True)
        (part / "state" / f"zero_pp_rank_{rank}_optim_states.pt").write_bytes(os.urandom(4096) + bytes([step]))
        if rank == 0:
            (part / "latest").write_text("state")
        mark_complete(part, rank, ranks, step)
        shutil.copytree(part, folder, dirs_exist_ok=True)
    return folder


DAMAGES = {
    "truncated": (lambda f: f.write_bytes(f.read_bytes()[:1000]), "holds 1,000 of its 4,097 bytes"),
    "zeroed": (lambda f: f.write_bytes(bytes(4097)), "is not the file written (its bytes changed)"),
    "deleted": (lambda f: f.unlink(), "is missing"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_resume_skips_a_damaged_newest_checkpoint_naming_it_and_why(tmp_path: Path, capsys, damage: str) -> None:
    from ray_jobs.train import resume_point

    storage = tmp_path / "ray"
    older = _checkpoint(storage / "train-key-1", "checkpoint_2026-01-01_00-00-04", 4)
    newest = _checkpoint(storage / "train-key-2", "checkpoint_2026-01-01_00-10-08", 8)
    (storage / "train-key-2" / "checkpoint_manager_snapshot.json").write_text("{}")  # Ray's, beside them
    assert resume_point(storage, "train-key", "smoke").folder == newest
    hurt, message = DAMAGES[damage]
    hurt(newest / "state" / "zero_pp_rank_1_optim_states.pt")
    capsys.readouterr()
    found = resume_point(storage, "train-key", "smoke")
    assert found.folder == older and found.step == 4 and found.problem is None
    err = capsys.readouterr().err
    assert f"warning: [smoke] skipped the checkpoint {newest}: state/zero_pp_rank_1_optim_states.pt {message}" in err
    assert err.count("skipped") == 1, err


def test_a_checkpoint_without_its_marks_is_skipped_and_none_whole_is_one_line(tmp_path: Path) -> None:
    from ray_jobs.train import resume_point

    storage = tmp_path / "ray"
    older = _checkpoint(storage / "train-key-1", "checkpoint_a", 4)
    newest = _checkpoint(storage / "train-key-1", "checkpoint_b", 8)
    (newest / "complete.rank1.json").unlink()  # rank 1 was killed before it had written its part
    assert resume_point(storage, "train-key", "smoke").folder == older
    (older / "complete.rank0.json").write_text("{garbage")
    with pytest.raises(ClozeMathError, match=rf"{storage}: no whole checkpoint of this trial to resume from \(2 "
                       r"damaged; the newest, train-key-1/checkpoint_b: rank 1's part did not finish\): remove "
                       rf"{storage / 'train-key'}-\* to train it afresh"):
        resume_point(storage, "train-key", "smoke")
    assert resume_point(storage, "train-other", "smoke") is None  # another trial's: nothing to resume


def test_a_checkpoint_write_that_fails_midway_leaves_none_and_the_one_before_is_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full disk after part of a checkpoint was copied: no half-written checkpoint where a resume would read it,
    the one before whole and resumed, one line naming the folder and what was kept; the next write lands whole."""
    import errno

    import torch

    from clozemath.files import storage_fault_advice
    from clozemath.train.checkpoint import check_checkpoint, mark_complete, write_checkpoint_whole
    from ray_jobs.train import resume_point

    storage = tmp_path / "ray"
    run = storage / "train-key-1"
    older = _checkpoint(run, "checkpoint_a", 4, ranks=1)
    part = tmp_path / "scratch"  # what the worker wrote (a temporary folder of its own)
    (part / "state").mkdir(parents=True)
    (part / "latest").write_text("state")
    (part / "state" / "zero_pp_rank_0_optim_states.pt").write_bytes(os.urandom(8192))
    mark_complete(part, 0, 1, 8)
    cut: list[str] = []
    copy = shutil.copyfile

    def full_disk(source: str, target: str, *, follow_symlinks: bool = True) -> str:
        if Path(source).stat().st_size <= 4096:
            return copy(source, target, follow_symlinks=follow_symlinks)
        Path(target).write_bytes(Path(source).read_bytes()[:4096])  # half the file, then the disk is full
        cut.append(target)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), target)

    monkeypatch.setattr(shutil, "copyfile", full_disk)
    with pytest.raises(ClozeMathError) as failed:
        write_checkpoint_whole(part, run / "checkpoint_b", torch.device("cpu"))
    assert len(cut) == 1 and not Path(cut[0]).exists()  # it was written in part, then removed with its folder
    message = str(failed.value)
    assert message == (f"{run}: the checkpoint checkpoint_b was not written (No space left on device); the "
                       "checkpoints before it are kept whole, and a resume starts from the newest")
    assert "\n" not in storage_fault_advice(message) and "run the same command" in storage_fault_advice(message)
    assert sorted(path.name for path in run.iterdir()) == [".rank0-checkpoint_a", "checkpoint_a"]
    assert check_checkpoint(older).problem is None
    assert resume_point(storage, "train-key", "smoke").folder == older

    monkeypatch.setattr(shutil, "copyfile", copy)  # room again
    write_checkpoint_whole(part, run / "checkpoint_b", torch.device("cpu"))
    found = resume_point(storage, "train-key", "smoke")
    assert found.folder == run / "checkpoint_b" and found.step == 8 and found.problem is None
    assert sorted(path.name for path in run.iterdir()) == [".rank0-checkpoint_a", "checkpoint_a", "checkpoint_b"]


def _rank_writes_its_part(rank: int, port: int, folder: Path, failing_rank: int | None) -> None:
    """One of two gloo ranks: its part of a checkpoint into `folder / "checkpoint_b"` (its copy failing on a full disk
    where it is `failing_rank`); what it ended with in `folder / f"rank{rank}.txt"`."""
    import errno

    import torch
    import torch.distributed as dist

    from clozemath.train.checkpoint import mark_complete, write_checkpoint_whole

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    part = folder / f"scratch{rank}"
    (part / "state").mkdir(parents=True)
    (part / "state" / f"zero_pp_rank_{rank}_optim_states.pt").write_bytes(os.urandom(8192))
    mark_complete(part, rank, 2, 8)
    if rank == failing_rank:
        def full_disk(source: str, target: str, *, follow_symlinks: bool = True) -> str:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), target)

        shutil.copyfile = full_disk
    try:
        write_checkpoint_whole(part, folder / "run" / "checkpoint_b", torch.device("cpu"))
        ended = "written"
    except ClozeMathError as exc:
        ended = str(exc)
    finally:
        dist.destroy_process_group()
    (folder / f"rank{rank}.txt").write_text(ended)


@pytest.mark.slow  # two processes join torch.distributed
@pytest.mark.parametrize("failing_rank", [None, 0, 1])
def test_two_ranks_write_a_checkpoint_whole_or_leave_none(tmp_path: Path, failing_rank: int | None) -> None:
    """Two ranks (gloo) each copy their part into rank 0's staging folder: the checkpoint appears whole, with both
    parts; where either rank's copy fails, none appears, no staging is left and both ranks end in one line (never
    waiting for each other)."""
    import torch.multiprocessing

    from clozemath.train.checkpoint import check_checkpoint

    (tmp_path / "run").mkdir()
    with closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(_rank_writes_its_part, args=(port, tmp_path, failing_rank), nprocs=2, join=True)
    ended = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    target = tmp_path / "run" / "checkpoint_b"
    if failing_rank is None:
        assert ended == ["written", "written"]
        checked = check_checkpoint(target)
        assert checked.problem is None and checked.step == 8
        assert sorted(path.name for path in (target / "state").iterdir()) == [
            "zero_pp_rank_0_optim_states.pt", "zero_pp_rank_1_optim_states.pt"]
        return
    other = 1 - failing_rank
    assert ended[failing_rank] == (f"{tmp_path / 'run'}: the checkpoint checkpoint_b was not written (No space left on "
                                   "device); the checkpoints before it are kept whole, and a resume starts from the "
                                   "newest")
    assert ended[other] == ended[failing_rank].replace("No space left on device", f"rank {failing_rank}'s part failed")
    assert list((tmp_path / "run").iterdir()) == []


def _assert_same_adapter(resumed: Path, reference: Path) -> None:
    """The same LoRA and special-token weights (CPU training resumes exactly: same data order, dropout, noise)."""
    import torch

    mine, theirs = _tensors(resumed), _tensors(reference)
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-4, atol=1e-6, msg=name)


TWELVE_STEPS = ["train.max_steps=12", "train.checkpoint_every=4", "train.max_failures=0", "eval.sets=[]"]
"""Checkpoints at steps 4, 8 and 12; a failure is not retried within the command; the adapter, not an evaluation, is
compared."""


@pytest.fixture(scope="module")
def twelve_steps_samples(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache folder of the samples `TWELVE_STEPS` runs train on, prepared once for the module (a run folder of
    its own prepares them afresh: ~30 s of Ray Data on 2 cores). `_with_samples` copies it into a run's folder."""
    from ray_jobs.preprocess import preprocess

    return preprocess(load_config(ROOT / SMOKE, TWELVE_STEPS), tmp_path_factory.mktemp("twelve_samples")).folder.parent


def _with_samples(folder: Path, samples: Path) -> Path:
    """`folder`, its run's samples (`<train.output_dir>/cache`) copied in from `samples`."""
    shutil.copytree(samples, folder / "runs" / "cache")
    return folder


@pytest.fixture(scope="module")
def straight_adapter(twelve_steps_samples: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The adapter of a `TWELVE_STEPS` run never interrupted: what a resumed one must end with."""
    from conftest import run_smoke

    folder = _with_samples(tmp_path_factory.mktemp("straight"), twelve_steps_samples)
    code, lines = run_smoke(folder, *TWELVE_STEPS)
    assert code == 0, "\n".join(lines[-30:])
    return folder / "runs" / "smoke" / "adapter"


@pytest.mark.slow
def test_a_failed_run_whose_newest_checkpoint_is_damaged_resumes_from_the_one_before_to_the_same_adapter(
    tmp_path: Path, straight_adapter: Path, twelve_steps_samples: Path,
) -> None:
    """Training fails at step 10 (the test hook, no retry), after its checkpoints of steps 4 and 8; the step-8 one
    is then cut short (as a full disk leaves it). The same command skips it, saying so, resumes from step 4 and ends
    with the adapter of a run never interrupted."""
    from conftest import run_smoke

    failing = [*TWELVE_STEPS, "train.fail_at_step=10"]
    code, lines = run_smoke(_with_samples(tmp_path / "failed", twelve_steps_samples), *failing)
    assert code == 2 and "1 of 1 trials failed" in lines[-1], lines[-10:]
    (first_run,) = (tmp_path / "failed" / "runs" / "smoke" / "ray").glob("train-*-1")
    newest = sorted(path for path in first_run.glob("checkpoint_*") if path.is_dir())[-1]
    largest = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    code, lines = run_smoke(tmp_path / "failed", *failing)
    assert code == 0, "\n".join(lines[-30:])
    console = "\n".join(lines)
    assert f"skipped the checkpoint {newest}: {largest.relative_to(newest)} holds" in console
    assert "from the checkpoint of step 4" in console and "Traceback" not in console
    _assert_same_adapter(tmp_path / "failed" / "runs" / "smoke" / "adapter", straight_adapter)
    assert [p.name for p in (tmp_path / "failed" / "runs" / "smoke" / "ray").iterdir()] == [
        first_run.name.removesuffix("-1") + "-2"]  # the spent run and its checkpoints removed


def _losses(database: Path) -> dict[int, float]:
    """The (one) trial run's logged training loss by step; each step logged once."""
    with closing(sqlite3.connect(database)) as db:
        rows = db.execute("SELECT step, value FROM metrics WHERE key = 'train/loss'").fetchall()
    assert len(rows) == len({step for step, _ in rows}), sorted(rows)
    return dict(rows)


def test_steps_from_a_checkpoint_are_logged_only_past_those_the_run_holds(tmp_path: Path) -> None:
    """The path a training that had ended before takes (its final checkpoint's steps, no report): steps 1-3 in the
    store keep their values, 4-5 come from the checkpoint's history."""
    from clozemath import tracking
    from clozemath.config import TrackingConfig
    from clozemath.records import train_metric
    from ray_jobs.reports import ForwardMetrics

    run = tracking.start_run(TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="e"), "trial")
    for step in (1, 2, 3):
        run.log_metrics(step, {train_metric("loss"): float(step)})
    history = [{"step": step, "total_steps": 5, train_metric("loss"): 10.0 + step} for step in range(1, 6)]
    ForwardMetrics(run, "trial").log_steps(history)
    assert _losses(tmp_path / "mlruns.db") == {1: 1.0, 2: 2.0, 3: 3.0, 4: 14.0, 5: 15.0}


@pytest.mark.slow
def test_a_resumed_run_logs_the_steps_before_its_checkpoint_that_its_tracking_store_lacks(
    tmp_path: Path, twelve_steps_samples: Path,
) -> None:
    """A driver killed after a checkpoint was written but before its steps were logged leaves the store without
    them. Here the store lacks them all: training fails at step 10 (checkpoints at 4 and 8), the store is moved
    away, and the same command resumes from step 8 into a fresh one. Every step is logged there once, those up to
    the checkpoint from it, with the losses the first store had logged."""
    from conftest import run_smoke

    failing = [*TWELVE_STEPS, "train.fail_at_step=10"]
    folder = _with_samples(tmp_path, twelve_steps_samples)
    code, lines = run_smoke(folder, *failing)
    assert code == 2 and "1 of 1 trials failed" in lines[-1], lines[-10:]
    first = _losses((folder / "mlruns.db").rename(folder / "first.db"))
    assert set(range(1, 9)) <= set(first), sorted(first)
    code, lines = run_smoke(folder, *failing)
    assert code == 0, "\n".join(lines[-30:])
    assert "from the checkpoint of step 8" in "\n".join(lines)
    resumed = _losses(folder / "mlruns.db")
    assert sorted(resumed) == list(range(1, 13))
    assert all(resumed[step] == first[step] for step in range(1, 9)), (resumed, first)


# --------------------------------------------------------------------------------------------------------------
# Signals as schedulers and terminals send them


def _start_run(tmp_path: Path, log: Path, *overrides: str) -> subprocess.Popen:
    """`clozemath run` of the smoke experiment, its outputs under `tmp_path` (`start_command`)."""
    return start_command(["run", SMOKE, *outputs(tmp_path), *overrides], log)


def _wait_for(process: subprocess.Popen, ready, seconds: float = 480) -> None:
    deadline = time.monotonic() + seconds
    while not ready() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the command ended before the signal"


def _statuses(database: Path) -> set[str]:
    with sqlite3.connect(database) as store:
        return {status for (status,) in store.execute("select status from runs")}


def test_sighup_ends_a_command_as_ctrl_c_does_with_exit_129(tmp_path: Path) -> None:
    path = tmp_path / "predictions.jsonl"
    rows = [{"id": f"m{i}", "dataset": "math", "generation": "\\boxed{9^{9^{9^9}}}", "gold": "1"} for i in range(50)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = subprocess.Popen([sys.executable, "-m", "clozemath_cli", "score", str(path)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(command, lambda: psutil.Process(command.pid).children(), 60)  # grading: its workers are up
    command.send_signal(signal.SIGHUP)
    out, err = command.communicate(timeout=30)
    assert command.returncode == 129 and err == "clozemath: interrupted\n", err


SIGNALLED_COMMAND = """
import os, signal, sys, time
from pathlib import Path
from clozemath import interrupts

ended, gone_after = Path(sys.argv[1]), float(sys.argv[2])
signalled = time.monotonic()
interrupts.stuck_when(lambda: 0 <= gone_after < time.monotonic() - signalled)
with interrupts.handled(), interrupts.on_stuck(lambda: ended.write_text("KILLED")):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    except KeyboardInterrupt:
        print("unwinding", flush=True)
        os._exit(1)  # what a call into a Ray that is gone does
"""


@pytest.mark.parametrize("gone_after", [0.0, 0.3])
def test_a_signal_that_ended_the_commands_ray_too_is_ended_by_the_watchdog_not_by_unwinding(
        tmp_path: Path, gone_after: float) -> None:
    """Sent to the process group, SIGTERM ends Ray's raylet and GCS too; a command that unwound as from Ctrl-C called
    into them and Ray ended it, exit 1, no word, its runs RUNNING (CI of 2026-12-05). Its thread now waits while the
    watchdog marks the runs and ends it."""
    ended = tmp_path / "ended"
    command = subprocess.run([sys.executable, "-c", SIGNALLED_COMMAND, str(ended), str(gone_after)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    output = command.stdout + command.stderr
    assert command.returncode == 143 and "unwinding" not in output, output
    assert output.strip().endswith("clozemath: interrupted") and ended.read_text() == "KILLED", output


def test_a_signal_to_the_command_alone_unwinds_it_as_ctrl_c(tmp_path: Path) -> None:
    ended = tmp_path / "ended"
    command = subprocess.run([sys.executable, "-c", SIGNALLED_COMMAND, str(ended), "-1"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert command.returncode == 1 and command.stdout == "unwinding\n", command.stdout + command.stderr
    assert not ended.exists()


STACKS_COMMAND = """
import os, sys, time
from pathlib import Path
from clozemath import console, interrupts

def waiting_on_a_trial():
    os.kill(os.getpid(), interrupts.STACKS_SIGNAL)
    time.sleep(0.5)

with interrupts.handled(), console.quiet_console(Path(sys.argv[1])):
    waiting_on_a_trial()
    print("went on")
"""


def test_sigusr2_prints_where_a_command_is_on_its_terminal_and_it_goes_on(tmp_path: Path) -> None:
    """Where a command seems stuck: `kill -USR2 PID` shows where each thread is, also once its output goes to its
    log (Ray's handler of SIGABRT prints nothing; SIGUSR1 stops a Tune run)."""
    log = tmp_path / "driver.log"
    command = subprocess.run([sys.executable, "-c", STACKS_COMMAND, str(log)], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    assert command.returncode == 0, command.stderr
    assert "most recent call first" in command.stderr and 'line 7 in waiting_on_a_trial' in command.stderr
    assert "went on" in log.read_text() and "waiting_on_a_trial" not in log.read_text()


HUNG_COMMAND = """
import time
from clozemath import interrupts

def waiting_on_a_trial_forever():
    print("step 30/30", flush=True)
    while True:
        time.sleep(0.1)

with interrupts.handled():
    waiting_on_a_trial_forever()
"""


def test_a_command_a_test_waits_on_in_vain_fails_it_with_its_stacks_console_and_logs_its_group_ended(
        tmp_path: Path) -> None:
    """What a hung `clozemath` command leaves a test (`conftest.ended`): a failure to read, not a silent timeout."""
    console, runs = tmp_path / "console.log", tmp_path / "runs"
    (runs / "smoke" / "logs").mkdir(parents=True)
    (runs / "smoke" / "logs" / "workers.log").write_text("the trial's last line\n")
    with open(console, "w") as out:
        process = subprocess.Popen([sys.executable, "-c", HUNG_COMMAND], cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while "step 30/30" not in console.read_text() and time.monotonic() < deadline:  # its handler in place
        time.sleep(0.05)
    with pytest.raises(pytest.fail.Exception) as failure:
        ended(process, 1, console, runs)
    message = str(failure.value)
    assert "did not end in 1 s" in message and "step 30/30" in message
    assert "in waiting_on_a_trial_forever" in message  # its stacks, printed onto its console
    assert "workers.log:\nthe trial's last line" in message
    assert process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(process.pid, 0)


def test_the_local_ray_is_gone_once_its_gcs_stops_listening_or_its_raylet_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ray_jobs import cluster

    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: True)
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    raylet = subprocess.Popen(["sleep", "60"])
    try:
        gone = cluster._local_ray_gone(address, [psutil.Process(raylet.pid)])
        assert not gone()
        raylet.kill()
        raylet.wait()
        assert gone()
        assert not cluster._local_ray_gone(address, [])()
        listener.close()
        assert cluster._local_ray_gone(address, [])()
    finally:
        listener.close()
        raylet.kill()
        raylet.wait()


@pytest.mark.slow
def test_sigterm_to_the_process_group_during_training_ends_in_one_line_and_resumes(smoke_samples: Path,
                                                                                    tmp_path: Path) -> None:
    """What `timeout` and Slurm send: SIGTERM to every process of the group, Ray's included. It ended in 60 s of
    silence (or at once: the CI of 2026-12-05), exit 1, runs left RUNNING; now: exit 143 within seconds, one line
    saying how to resume, the runs KILLED; the same command resumes it to the end."""
    shutil.copytree(smoke_samples, tmp_path / "runs" / "cache")
    overrides = [*LEARNS, "train.num_workers=1", "train.max_steps=30", "train.checkpoint_every=10", "eval.sets=[]"]
    # one worker and no evaluation: the signal's path and the resumed run's end are what is tested; 30 steps keep
    # training going for seconds after the first one is seen
    log = tmp_path / "first.log"
    first = _start_run(tmp_path, log, *overrides)
    _wait_for(first, lambda: TRAINING_STEP.search(log.read_text()))
    signalled = time.monotonic()
    os.killpg(first.pid, signal.SIGTERM)
    code = ended(first, 60, log, tmp_path / "runs")
    console = log.read_text()
    # ended once its Ray was seen gone, not at the watchdog's deadline (Ray 2.60's GCS lingers after the signal)
    assert code == 143 and time.monotonic() - signalled < interrupts.UNWIND_S, console[-3000:]
    assert console.rstrip().endswith("clozemath: interrupted; the grid resumes where it stopped with: "
                                     + shlex.join(["clozemath", "run", SMOKE, *outputs(tmp_path), *overrides])), (
        console[-3000:])
    assert "Traceback" not in console
    assert _statuses(tmp_path / "mlruns.db") == {"KILLED"}
    again = _start_run(tmp_path, tmp_path / "again.log", *overrides)
    assert ended(again, 480, tmp_path / "again.log", tmp_path / "runs") == 0, (
        (tmp_path / "again.log").read_text()[-3000:])
    assert _statuses(tmp_path / "mlruns.db") == {"FINISHED"}


@pytest.mark.slow
def test_sigterm_while_ray_starts_ends_in_one_line(tmp_path: Path) -> None:
    """It exited 15 with no word (ray.init's own handler); now as Ctrl-C."""
    log = tmp_path / "run.log"
    command = _start_run(tmp_path, log)

    def ray_starting() -> bool:
        try:
            return any(child.name().startswith("gcs_server") for child in psutil.Process(command.pid).children())
        except psutil.Error:
            return False

    _wait_for(command, ray_starting, 120)
    command.send_signal(signal.SIGTERM)
    code = ended(command, 60, log, tmp_path / "runs")
    console = log.read_text()
    assert code == 143 and "clozemath: interrupted; the grid resumes where it stopped with:" in console, console
    assert "Traceback" not in console


# --------------------------------------------------------------------------------------------------------------
# The tracking store: hung, busy, damaged


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers: its URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for connection in held:
        connection.close()
    listener.close()


def test_a_tracking_server_that_never_answers_is_refused_in_seconds_before_ray(tmp_path: Path, capsys,
                                                                                silent_server: str) -> None:
    started = time.monotonic()
    error = refused(capsys, "run", str(ROOT / SMOKE), f"train.output_dir={tmp_path / 'runs'}",
                    f"tracking.uri={silent_server}")
    assert f"tracking.uri '{silent_server}': the server accepts connections but gives no answer within" in error
    assert time.monotonic() - started < SECONDS and not (tmp_path / "runs").exists()


def test_every_tracking_call_ends_within_its_bound_naming_the_server(silent_server: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that stops answering mid-run: each call gives up (`HTTP_LIMITS`: here 1 s, one retry), in one
    line naming it and what was kept."""
    from clozemath.tracking import TrackedRun

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    started = time.monotonic()
    with pytest.raises(ClozeMathError, match=rf"tracking server '{silent_server}' stopped answering \(no answer "
                       r"within 1 s, 2 tries\); what the run made stays in its folder"):
        TrackedRun(silent_server, "0" * 32).log_metrics(1, {"train/loss": 1.0})
    assert time.monotonic() - started < SECONDS
    started = time.monotonic()
    with pytest.raises(ClozeMathError, match="stopped answering"):  # ending the run FAILED waits no more
        TrackedRun(silent_server, "0" * 32).end(succeeded=False)
    assert time.monotonic() - started < 1


def test_a_server_one_process_found_silent_costs_the_next_seconds_not_its_bound(
        silent_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A trial found the server silent (its calls waited out `HTTP_LIMITS`): the grid's driver, another process on
    the machine, checks the server's health in `HEALTH_TIMEOUT_S` and gives up at once, so the whole run ends within
    about 30 s; once the server answers its health check again, the word is cleared and calls go through."""
    from clozemath import tracking

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tracking.tempfile, "tempdir", None)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    with pytest.raises(ClozeMathError, match="stopped answering"):
        tracking.TrackedRun(silent_server, "0" * 32).log_metrics(1, {"train/loss": 1.0})
    assert tracking._unanswered_mark(silent_server).is_file()
    monkeypatch.setattr(tracking, "_unanswering", set())  # as the driver, which has not called the server yet
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")  # its own bound would be far longer
    started = time.monotonic()
    with pytest.raises(ClozeMathError, match="stopped answering"):
        tracking.TrackedRun(silent_server, "0" * 32).end(succeeded=False)
    assert time.monotonic() - started < tracking.HEALTH_TIMEOUT_S + 2

    monkeypatch.setattr(tracking, "_unanswering", set())
    healthy = _HealthyServer()
    try:
        marked = tracking._unanswered_mark(healthy.url)
        marked.write_text(healthy.url)
        assert not tracking._known_unanswering(healthy.url) and not marked.exists()
    finally:
        healthy.close()


class _HealthyServer:
    """A server that answers `/health` with 200."""

    def __init__(self) -> None:
        import http.server

        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"OK")

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Health)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_busy_sqlite_store_is_waited_for(tmp_path: Path) -> None:
    """Another writer holds the store (an open exclusive transaction) for seconds: the call waits for it and
    logs, rather than fail a trial."""
    from clozemath import tracking
    from clozemath.config import TrackingConfig

    store = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="busy")
    run = tracking.start_run(store, "trial")
    holder = sqlite3.connect(tmp_path / "mlruns.db", isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(8.0, lambda: holder.execute("COMMIT"))
    release.start()
    try:
        run.log_metrics(1, {"train/loss": 2.5})
    finally:
        release.join()
        holder.close()
    [metric] = tracking.client(store.uri).get_metric_history(run.run_id, "train/loss")
    assert metric.value == 2.5


def test_a_store_busy_past_the_wait_is_one_line_saying_what_stays_and_how_to_log_it(tmp_path: Path) -> None:
    """Held past the wait (10 min by default, 2 s here): one line naming the store, never MLflow's autoflush error;
    the writer's work is not lost (the caller's results stay in the run folder; the same command logs them)."""
    from clozemath import tracking
    from clozemath.config import TrackingConfig

    store = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="busy")
    run = tracking.start_run(store, "trial")
    holder = sqlite3.connect(tmp_path / "mlruns.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    started = time.monotonic()
    try:
        with pytest.raises(ClozeMathError) as caught:
            tracking.answered(store.uri, lambda: tracking.client(store.uri).log_param(run.run_id, "x", "1"),
                              busy_wait_s=2.0)
    finally:
        holder.execute("COMMIT")
        holder.close()
    message = str(caught.value)
    assert "\n" not in message and f"tracking store '{store.uri}': held by another writer for 2 s" in message
    assert "run the same command once the store is free" in message
    assert time.monotonic() - started < 60  # SQLite's own busy timeout per try, then the wait: not MLflow's 143 s


@pytest.mark.parametrize("store, message", [
    (lambda tmp: (tmp / "m.db").write_text("not a database\n"), "is not a SQLite database"),
    (lambda tmp: (tmp / "m.db").mkdir(), "is a folder, not a database file"),
], ids=["not-a-database", "a-folder"])
def test_a_damaged_sqlite_store_is_refused_before_ray_by_run_and_report(tmp_path: Path, capsys, store,
                                                                        message: str) -> None:
    store(tmp_path)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    error = refused(capsys, "run", str(ROOT / SMOKE), f"train.output_dir={tmp_path / 'runs'}", f"tracking.uri={uri}")
    assert f"tracking.uri '{uri}': '{tmp_path / 'm.db'}' {message}" in error
    error = refused(capsys, "report", "--experiment", "x", "--tracking-uri", uri, "--out", str(tmp_path / "r"))
    assert f"--tracking-uri '{uri}': '{tmp_path / 'm.db'}' {message}" in error
    assert not (tmp_path / "runs").exists() and not (tmp_path / "r").exists()


def test_a_name_with_an_apostrophe_is_found_again_in_the_store(tmp_path: Path) -> None:
    from clozemath import tracking
    from clozemath.config import TrackingConfig

    store = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="o'brien's")
    run = tracking.start_run(store, "o'brien", tags={"trial": "o'brien", "grid": 'say "hi"'})
    assert [found.info.run_id for found in tracking.find_runs(store, {"trial": "o'brien"})] == [run.run_id]
    assert [found.info.run_id for found in tracking.find_runs(store, {"grid": 'say "hi"'})] == [run.run_id]


@pytest.mark.parametrize("name, message", [
    ("x" * 300, "is 300 bytes long: a folder's name holds at most 200"),
    ("both'\"quotes", "holds both quotes"),
    ("tab\there", "would leave train.output_dir or name an odd folder"),
], ids=["300-characters", "both-quotes", "control-character"])
def test_a_name_past_the_file_systems_limits_is_refused_before_work(tmp_path: Path, capsys, name: str,
                                                                     message: str) -> None:
    error = refused(capsys, "run", str(ROOT / SMOKE), f"name={name}", *outputs(tmp_path))
    assert "'name'" in error and message in error
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------------------------------
# The run's other files read back: the preprocessing cache, the compile cache's marks


@pytest.mark.parametrize("damage, problem", [
    (lambda folder: (folder / "meta.json").write_text("{oops"), "meta.json cannot be read: not JSON"),
    (lambda folder: (folder / "meta.json").write_text("[]"), "meta.json is not what preprocessing writes"),
    (lambda folder: (folder / "rows" / "0.parquet").write_bytes(b"PAR1\0\0"), "its rows cannot be read"),
    (lambda folder: (folder / "rows" / "0.parquet").unlink(), "0 rows in rows/, 3 in meta.json"),
], ids=["garbage", "a-list", "truncated-rows", "rows-gone"])
def test_a_damaged_preprocessing_cache_is_one_line_naming_it_and_the_way_out(tmp_path: Path, damage,
                                                                            problem: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from clozemath.data.sources import load_problems
    from ray_jobs.preprocess import cache_key, preprocess

    config = load_plan(ROOT / SMOKE, outputs(tmp_path)).experiments[0]
    folder = tmp_path / "cache" / cache_key(config, load_problems("gsm8k", "train", None, config.data.limit))
    (folder / "rows").mkdir(parents=True)
    pq.write_table(pa.table({"input_ids": [[1], [2], [3]]}), folder / "rows" / "0.parquet")
    meta = {"num_rows": 3, "num_sentinels": 1, "kinds": {"lm": 3}, "dropped_for_length": 0, "num_tokens": 3}
    (folder / "meta.json").write_text(json.dumps(meta))
    assert preprocess(config, tmp_path / "cache").num_rows == 3  # whole: read from the cache
    damage(folder)
    with pytest.raises(ClozeMathError, match=rf"{folder}: a damaged preprocessing cache \({problem}.*\): remove it "
                       r"and run again \(the set is prepared afresh\)"):
        preprocess(config, tmp_path / "cache")


def test_a_compile_cache_mark_in_the_way_is_a_warning_never_a_failure(tmp_path: Path, capsys) -> None:
    from clozemath.train.compilation import compiled_before, mark_compiled

    (tmp_path / "compiled").write_text("not a folder")
    assert not compiled_before(tmp_path, "key")
    mark_compiled(tmp_path, "key")  # no exception: the run goes on
    assert f"{tmp_path / 'compiled' / 'key'}: the compile cache's mark cannot be written" in capsys.readouterr().err
    (tmp_path / "compiled").unlink()
    mark_compiled(tmp_path, "key")
    assert compiled_before(tmp_path, "key")



# --------------------------------------------------------------------------------------------------------------
# SIGKILL at any moment: nothing finished is lost, the same command ends as an uninterrupted one


@pytest.mark.slow
def test_sigkill_while_a_checkpoint_is_written_then_the_same_command_ends_with_the_same_adapter(
    tmp_path: Path, straight_adapter: Path, twelve_steps_samples: Path,
) -> None:
    """Killed (the whole process group, SIGKILL: no chance to clean up) as soon as the step-8 checkpoint's staging
    folder (or, past it, the checkpoint itself) appears, while it is written: the same command resumes from the
    newest whole checkpoint and ends with the adapter of a run never interrupted."""
    log = tmp_path / "killed.log"
    first = _start_run(_with_samples(tmp_path, twelve_steps_samples), log, *TWELVE_STEPS)
    storage = tmp_path / "runs" / "smoke" / "ray"

    def step_8_written() -> bool:
        staging = [path for path in storage.glob("train-*-1/.checkpoint_*") if path.is_dir()]
        return len(list(storage.glob("train-*-1/checkpoint_*"))) + bool(staging) >= 2

    _wait_for(first, step_8_written)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    again = _start_run(tmp_path, tmp_path / "again.log", *TWELVE_STEPS)
    assert ended(again, 480, tmp_path / "again.log", tmp_path / "runs") == 0, (
        (tmp_path / "again.log").read_text()[-3000:])
    console = (tmp_path / "again.log").read_text()
    assert "from the checkpoint of step" in console and "Traceback" not in console
    _assert_same_adapter(tmp_path / "runs" / "smoke" / "adapter", straight_adapter)


def test_predictions_a_killed_evaluation_appended_are_taken_up_less_a_line_cut_short(tmp_path: Path) -> None:
    from clozemath.eval.folder import read_restored

    rows = [{"id": f"gsm8k/test/{i}", "dataset": "gsm8k", "decoding": "greedy", "generation": "#### 1", "gold": "1"}
            for i in range(3)]
    partial = tmp_path / "gsm8k.partial.jsonl"
    partial.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"id": "gsm8k/te')
    assert [p.id for p in read_restored(partial, cut_tail=True)] == [row["id"] for row in rows]
    assert partial.read_text().endswith("}\n")  # the cut line is gone from the file: appends follow whole lines
    partial.write_text(json.dumps(rows[0]) + "\n{oops\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(ClozeMathError, match=rf"{partial}:2: not valid JSON .*: a damaged predictions file; remove "
                       rf"{partial} and run again \(the set is evaluated afresh\)"):
        read_restored(partial, cut_tail=True)


def _eval_args(tmp_path: Path) -> list[str]:
    """`clozemath eval` of the base model (few-shot) on 12 GSM8K problems, greedy, in 3 batches."""
    return ["eval", SMOKE, *outputs(tmp_path), "method=base", "eval.sets=[{dataset: gsm8k, limit: 12}]",
            "eval.batch_size=1"]


def _eval(tmp_path: Path, log: Path) -> subprocess.Popen:
    return start_command(_eval_args(tmp_path), log)


def _predictions(output: Path) -> list[str]:
    (file,) = output.glob("runs/evals/smoke-*/eval/predictions/gsm8k.jsonl")
    return [json.dumps(json.loads(line), sort_keys=True) for line in file.read_text().splitlines()]


@pytest.mark.slow
def test_sigkill_while_predictions_are_written_then_the_same_command_ends_with_the_same_predictions(
    tmp_path: Path,
) -> None:
    """Killed once its first predictions are appended: the same command takes them up (a line cut short dropped),
    evaluates the rest only, and writes the predictions an uninterrupted evaluation writes (greedy)."""
    first = _eval(tmp_path / "killed", tmp_path / "killed.log")
    partial = lambda: list((tmp_path / "killed").glob("runs/evals/smoke-*/eval/predictions/gsm8k.partial.jsonl"))  # noqa: E731
    _wait_for(first, lambda: partial() and partial()[0].read_text().count("\n") >= 1)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    with partial()[0].open("a") as torn:
        torn.write('{"id": "gsm8k/test/1')  # a line the kill cut short
    again = _eval(tmp_path / "killed", tmp_path / "again.log")
    assert ended(again, 300, tmp_path / "again.log", tmp_path / "killed" / "runs") == 0, (
        (tmp_path / "again.log").read_text()[-3000:])
    assert "predictions from before" in (tmp_path / "again.log").read_text()
    straight = _eval(tmp_path / "straight", tmp_path / "straight.log")
    assert ended(straight, 300, tmp_path / "straight.log", tmp_path / "straight" / "runs") == 0, (
        (tmp_path / "straight.log").read_text()[-3000:])
    assert _predictions(tmp_path / "killed") == _predictions(tmp_path / "straight")
    assert len(_predictions(tmp_path / "straight")) == 12


# --------------------------------------------------------------------------------------------------------------
# Ray on a shared machine


@pytest.mark.slow
def test_two_runs_of_different_experiments_started_together_both_finish(smoke_samples: Path,
                                                                         tmp_path: Path) -> None:
    """Each starts a Ray of its own (the second joined the first's and died: "When connecting to an existing
    cluster, num_cpus and num_gpus must not be provided"), and says so first."""
    shutil.copytree(smoke_samples, tmp_path / "runs" / "cache")
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    runs = [_start_run(tmp_path, log, *LEARNS, f"name={name}", "train.num_workers=1", "train.max_steps=2",
                       "eval.sets=[]")  # a short training each, not evaluated: two Rays side by side are the test
            for log, name in zip(logs, ("first", "second"))]
    codes = [ended(run, 480, log, tmp_path / "runs") for run, log in zip(runs, logs)]
    consoles = [log.read_text() for log in logs]
    assert codes == [0, 0], [console[-3000:] for console in consoles]
    for console in consoles:
        assert console.startswith("ray: started on this machine"), console[:500]
    assert _statuses(tmp_path / "mlruns.db") == {"FINISHED"}


# --------------------------------------------------------------------------------------------------------------
# Storage: full, read-only, in a loop


def test_a_full_disk_under_logs_loses_neither_the_command_nor_its_error(tmp_path: Path) -> None:
    """The command's log on a full disk (`/dev/full`): its error still reaches the console, in one line, after a
    warning naming the log (it ended with exit 1 and no word)."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "driver.log").symlink_to("/dev/full")
    code = ("import sys\nfrom pathlib import Path\nfrom clozemath.errors import ClozeMathError\n"
            "from ray_jobs.logs import logged\n"
            "try:\n    with logged(Path(sys.argv[1])):\n        print('x' * 100_000)\n"
            "        raise ClozeMathError('the real error')\n"
            "except ClozeMathError as exc:\n    print(f'clozemath: error: {exc}', file=sys.stderr)\n    sys.exit(2)\n")
    ended = subprocess.run([sys.executable, "-c", code, str(tmp_path / "logs")], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert ended.returncode == 2, ended.stderr[-2000:]
    assert f"warning: {tmp_path / 'logs' / 'driver.log'}: the log cannot be written (No space left on device)" in \
        ended.stderr
    assert ended.stderr.endswith("clozemath: error: the real error\n") and "Traceback" not in ended.stderr


def test_a_symlink_loop_as_the_output_folder_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    error = refused(capsys, "run", str(ROOT / SMOKE), f"train.output_dir={tmp_path / 'loop'}",
                    f"tracking.uri=sqlite:///{tmp_path / 'mlruns.db'}")
    assert f"train.output_dir: cannot make the folder '{tmp_path / 'loop'}'" in error and "loop" in error


def test_a_huge_data_file_of_one_line_is_refused_before_it_is_read_whole(tmp_path: Path) -> None:
    """A 2 GB sparse file (no newline): refused at its first line's budget, in seconds and little memory (it was
    read whole into memory to be hashed, 2.9 GB)."""
    from test_hostile import cli

    data = tmp_path / "train.jsonl"
    with data.open("wb") as sparse:
        sparse.truncate(2 << 30)
    ended = cli("run", str(ROOT / SMOKE), *outputs(tmp_path), f"data.path={data}")
    ended.one_line_error(f"{data}:1: a line longer than")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A file system of 3 MB (a tmpfs: needs the right to mount; skipped without it)."""
    folder = tmp_path / "small"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.slow
def test_a_full_disk_during_a_run_is_one_line_naming_where_and_what_was_kept(tmp_path: Path,
                                                                            small_disk: Path) -> None:
    """The run's folder on a disk too small for its data (the tokenizer's copy alone is 9 MB): one line saying the
    disk is full, where, and that the same command goes on once there is room."""
    from conftest import run_smoke

    code, lines = run_smoke(tmp_path, f"train.output_dir={small_disk / 'runs'}")
    assert code == 2 and "Traceback" not in "\n".join(lines), lines[-10:]
    assert lines[-1].startswith("clozemath: error: 1 of 1 trials failed; smoke: "), lines[-5:]
    assert "No space left on device" in lines[-1] and f"(writing under {small_disk / 'runs' / 'smoke'})" in lines[-1]
    assert "what finished is kept" in lines[-1] and "run the same command to go on" in lines[-1]


def test_a_tracking_store_in_a_read_only_folder_is_refused_before_work_by_report_and_run(tmp_path: Path, capsys,
                                                                                     small_disk: Path) -> None:
    """The store's folder read-only (it gave `OSError: [Errno 30]` from the store's lock file, a traceback)."""
    with closing(sqlite3.connect(small_disk / "m.db")) as store:
        store.execute("create table t (x)")
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    uri = f"sqlite:///{small_disk / 'm.db'}"
    error = refused(capsys, "report", "--experiment", "x", "--tracking-uri", uri, "--out", str(tmp_path / "r"))
    assert f"--tracking-uri '{uri}': cannot write in '{small_disk}'" in error
    error = refused(capsys, "run", str(ROOT / SMOKE), f"train.output_dir={tmp_path / 'runs'}", f"tracking.uri={uri}")
    assert f"cannot write in '{small_disk}'" in error
