"""The console a person watches: sparse bars off a terminal, worker events drawn by the driver, the process's own
output into a log file; overrides anywhere on the command line; then `clozemath run` on the smoke experiment end to
end (slow), its whole console read as a person would, with its log files, and a trial failing on a user mistake."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from clozemath import console, tracking
from clozemath_cli import build_parser, parse_args
from clozemath.config import TrackingConfig
from conftest import LEARNS, SmokeRun, run_smoke

MAX_CONSOLE_LINES = 60


class Captured(io.StringIO):
    def isatty(self) -> bool:
        return False


@pytest.fixture
def plain_console(monkeypatch: pytest.MonkeyPatch) -> tuple[Captured, Captured]:
    """This process's console, on two captured (not terminal) streams."""
    out, err = Captured(), Captured()
    monkeypatch.setattr(console, "_console", console.Console(out, err))
    monkeypatch.delenv(console.EVENTS_ENV_VAR, raising=False)
    return out, err


def test_a_bar_off_a_terminal_prints_its_first_step_and_a_line_per_tenth(plain_console) -> None:
    _, err = plain_console
    for step in range(1, 251):
        console.progress("t", "[x] training", step, 250, [f"loss {1 / step:.3f}"], rate_unit="steps")
    lines = err.getvalue().splitlines()
    assert len(lines) == 11 and all(line.startswith("[x] training ") for line in lines)
    assert [line.split()[2] for line in lines] == ["1/250", *(f"{25 * tenth}/250" for tenth in range(1, 11))]
    assert "steps/s" not in lines[0] and "steps/s  ETA" in lines[1]  # its clock starts at its first step
    assert lines[-1].startswith("[x] training 250/250 [####################] 100%  loss 0.004") and "ETA" not in lines[-1]


def test_a_bar_off_a_terminal_also_prints_when_half_a_minute_passed_since_its_last_line(plain_console) -> None:
    _, err = plain_console
    start = 1000.0
    for step in range(1, 41):  # 40 of 1000 steps (no tenth passed), one every 2 s
        console.console().progress("t", "[x] training", step, 1000, rate_unit="steps", at=start + 2 * (step - 1))
    lines = err.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["1/1000", "16/1000", "31/1000"]  # at 0 s, then 30 s apart
    assert lines[1].endswith("0.50 steps/s  ETA 32:48") and "ETA" not in lines[0]  # 15 steps in 30 s
    console.console().progress("t", "[x] training", 40, 1000, at=start + 200)  # moved since: printed
    console.console().progress("t", "[x] training", 40, 1000, at=start + 300)  # not moved: nothing new
    assert [line.split()[2] for line in err.getvalue().splitlines()[3:]] == ["40/1000"]


def test_workers_report_their_first_step_then_about_every_fifteen_seconds() -> None:
    from ray_jobs.train import REPORT_EVERY_S, ReportPace

    clock = iter([0.0, 8.0, 40.0, 58.0, 70.0, 82.0, 83.0])  # built, then each report's time on this rank
    pace = ReportPace(report_every=10, clock=lambda: next(clock))
    slowest = lambda seconds: seconds * 2  # noqa: E731 (another rank, twice as slow, sets the pace)
    assert pace.due(1)  # the first step: at once
    pace.reported(1, slowest)  # 16 s for its step: every step
    assert pace.due(2)
    pace.reported(2, slowest)  # 64 s for 1 step
    assert pace.due(3)
    pace.reported(4, slowest)  # 36 s for 2 steps: 18 s a step, still every step
    assert pace.due(5)
    pace.reported(6, slowest)  # 24 s for 2 steps: 12 s a step, every step (15 s / 12 s)
    pace.reported(16, slowest)  # 24 s for 10 steps: 2.4 s a step, 6 steps apart
    assert [pace.due(step) for step in (21, 22)] == [False, True] and 6 * 2.4 <= REPORT_EVERY_S
    pace.reported(22, lambda seconds: 0.06)  # fast steps: at most report_every apart
    assert not pace.due(31) and pace.due(32)


def test_a_bar_done_at_its_first_step_claims_no_rate(plain_console) -> None:
    _, err = plain_console
    console.progress("e", "[x] eval gsm8k", 4, 4, ["accuracy 25.0%"], rate_unit="problems")
    assert err.getvalue() == "[x] eval gsm8k 4/4 [####################] 100%  accuracy 25.0%\n"


def test_a_workers_event_line_is_drawn_and_other_lines_are_not(plain_console, monkeypatch, capsys) -> None:
    monkeypatch.setenv(console.EVENTS_ENV_VAR, "1")
    monkeypatch.setattr(console, "_console", None)
    console.phase("[x] loading the model", once=True)  # in a worker: a marked line on stdout, nothing drawn
    console.warn("math-verify ran past 5 s")
    sent = capsys.readouterr().out.splitlines()
    assert len(sent) == 2 and all(line.startswith(console.MARKER) for line in sent)

    out, err = Captured(), Captured()
    monkeypatch.setattr(console, "_console", console.Console(out, err))  # the driver
    assert all(console.replay(f"(RayTrainWorker pid=7) {line}") for line in sent + sent)
    assert not console.replay("(RayTrainWorker pid=7) Setting accelerator to CPU")
    assert err.getvalue().splitlines() == ["[x] loading the model", "warning: math-verify ran past 5 s"]  # each once
    console.phase("[x] trial t: started")
    console.phase("[x] trial t: started")  # a restart says so again
    assert err.getvalue().splitlines()[2:] == ["[x] trial t: started"] * 2


def test_a_workers_bar_replayed_in_one_burst_keeps_the_workers_clock(plain_console, monkeypatch, capsys) -> None:
    """Ray sends a worker's output to the driver in batches: the rate comes from when the steps happened there."""
    monkeypatch.setenv(console.EVENTS_ENV_VAR, "1")
    monkeypatch.setattr(console, "_console", None)
    clock = iter([1000.0, 1010.0, 1020.0])  # the worker's steps: 50, 100 and 200 problems, ten seconds apart
    monkeypatch.setattr(console.time, "time", lambda: next(clock))
    for done in (50, 100, 200):
        console.progress("e", "[x] eval gsm_p1", done, 200, rate_unit="problems")
    sent = capsys.readouterr().out.splitlines()

    out, err = Captured(), Captured()
    monkeypatch.setattr(console, "_console", console.Console(out, err))  # the driver, all at once
    monkeypatch.setattr(console.time, "time", lambda: 5000.0)
    assert all(console.replay(line) for line in sent)
    assert err.getvalue().splitlines()[-1].endswith("100%  7.50 problems/s  in 0:20")  # 150 problems in 20 s


def test_a_worker_sends_a_bars_moves_at_each_new_percent_its_end_and_half_a_second_apart(monkeypatch, capsys) -> None:
    """An evaluation moves its bar once a prediction (hundreds a second on a GPU): a worker sends the moves that show,
    not a line of its log each."""
    monkeypatch.setenv(console.EVENTS_ENV_VAR, "1")
    monkeypatch.setattr(console, "_console", None)
    monkeypatch.setattr(console, "_sent", console._Sent())
    now = [1000.0]
    monkeypatch.setattr(console.time, "time", lambda: now[0])
    for done in range(1, 1001):  # 1,000 predictions, 1 ms apart: a percent every ten
        console.progress("e", "[x] eval gsm8k", done, 1000)
        now[0] += 0.001
    sent = [json.loads(line.removeprefix(console.MARKER))["done"] for line in capsys.readouterr().out.splitlines()]
    assert sent == [1, *range(10, 1001, 10)]
    for done in range(1, 4):  # 3 predictions: each a new percent
        console.progress("f", "[x] eval tiny", done, 3)
    assert len(capsys.readouterr().out.splitlines()) == 3
    for done in (1, 2, 3):  # 3 of 1,000, ten seconds apart (a slow CPU): within a percent, each sent after 0.5 s
        console.progress("g", "[x] eval slow", done, 1000)
        now[0] += 10.0
    assert len(capsys.readouterr().out.splitlines()) == 3


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


STATUS = "greedy decoding 5 problems, token 180/256"


def test_a_bars_status_is_drawn_after_its_numbers_until_the_next_and_not_on_its_last_line() -> None:
    """On a terminal the bar is redrawn in place with its status (a batch decoding between two predictions), and
    keeps it as it moves; its last line, and a bar not drawn, take none."""
    err = Terminal()
    drawn = console.Console(Captured(), err)
    drawn.progress("e", "[x] eval gsm8k", 12, 50, ["accuracy 8.3%"], rate_unit="problems", at=1000.0)
    drawn.status("e", STATUS, at=1012.0)
    drawn.status("other", "beam decoding 1 problem, token 3/256", at=1012.0)
    redraws = err.getvalue().split("\r\x1b[K")
    assert redraws[-1] == f"[x] eval gsm8k 12/50 [#####...............]  24%  accuracy 8.3%  · {STATUS}"
    drawn.progress("e", "[x] eval gsm8k", 13, 50, ["accuracy 7.7%"], rate_unit="problems", at=1020.0)
    assert err.getvalue().split("\r\x1b[K")[-1].endswith(f"0.05 problems/s  ETA 12:20  · {STATUS}")  # 1 in 20 s
    drawn.progress("e", "[x] eval gsm8k", 50, 50, ["accuracy 10.0%"], rate_unit="problems", at=1100.0)
    last = err.getvalue().split("\r\x1b[K")[-1]
    assert last.endswith("in 1:40\n") and "·" not in last and err.getvalue().count("\n") == 1  # redrawn in place


def test_off_a_terminal_a_status_is_a_line_only_half_a_minute_after_the_bars_last(plain_console) -> None:
    _, err = plain_console
    drawn = console.console()
    drawn.progress("e", "[x] eval gsm8k", 0, 50, ["accuracy -"], rate_unit="problems", at=1000.0)
    for second in range(10, 70, 10):  # a status every 10 s, each a token count further
        drawn.status("e", f"greedy decoding 16 problems, token {second}/256", at=1000.0 + second)
    lines = err.getvalue().splitlines()
    assert [line.rsplit("token ", 1)[-1] if "·" in line else "-" for line in lines] == ["-", "30/256", "60/256"]


def test_a_status_reaches_the_console_at_most_every_ten_seconds_a_bar_and_only_when_new(plain_console,
                                                                                      monkeypatch) -> None:
    """The decoders report at every look (every step of a CPU, hundreds a second on a GPU): the console hears a bar's
    status when it says something new and ten seconds have passed since its last; a bar that ends forgets it."""
    _, err = plain_console
    monkeypatch.setattr(console, "_statuses", console._Statuses())
    drawn = []
    monkeypatch.setattr(console.console(), "status", lambda key, text, at: drawn.append((key, text, at)))
    now = [1000.0]
    monkeypatch.setattr(console.time, "time", lambda: now[0])
    for step in range(3001):  # 30 s of steps, 10 ms apart
        now[0] = 1000.0 + step / 100
        console.status("e", f"greedy decoding 3 problems, token {step}/4000")
        console.status("f", "beam decoding 1 problem, token 7/256")  # the same text all along
    assert [(key, text.rsplit(" ", 1)[-1]) for key, text, _ in drawn] == [
        ("e", "0/4000"), ("f", "7/256"), ("e", "1000/4000"), ("e", "2000/4000"), ("e", "3000/4000")
    ]
    assert [at for key, _, at in drawn if key == "e"] == pytest.approx([1000.0, 1010.0, 1020.0, 1030.0])
    console.progress("e", "[x] eval gsm8k", 50, 50)  # the bar ends: the next one's first status comes at once
    console.status("e", "greedy decoding 2 problems, token 1/256")
    assert drawn[-1][1] == "greedy decoding 2 problems, token 1/256"


def test_a_workers_status_is_drawn_on_the_drivers_bar(plain_console, monkeypatch, capsys) -> None:
    """An evaluation actor (or the training worker) reports where its batch is; the driver draws it on the set's bar
    that the driver (or the worker) moves."""
    monkeypatch.setenv(console.EVENTS_ENV_VAR, "1")
    monkeypatch.setattr(console, "_console", None)
    monkeypatch.setattr(console, "_statuses", console._Statuses())
    console.status("e", STATUS)
    sent = capsys.readouterr().out.splitlines()
    assert len(sent) == 1 and sent[0].startswith(console.MARKER)

    err = Terminal()
    monkeypatch.setattr(console, "_console", console.Console(Captured(), err))  # the driver
    console.progress("e", "[x] eval gsm8k", 0, 50, ["accuracy -"], rate_unit="problems")
    assert console.replay(f"(Evaluator pid=7) {sent[0]}")
    assert err.getvalue().endswith(f"[x] eval gsm8k 0/50 [....................]   0%  accuracy -  · {STATUS}")


def test_our_logged_warnings_reach_the_console(plain_console) -> None:
    import logging

    _, err = plain_console
    logging.getLogger("clozemath.tasks.math").warning("grading ran past %d s", 5)
    assert err.getvalue() == "warning: grading ran past 5 s\n"


def test_quiet_console_sends_python_and_native_output_to_the_log(tmp_path: Path, capsys) -> None:
    log = tmp_path / "logs" / "driver.log"
    with console.quiet_console(log):
        print("a library's print")
        os.write(2, b"native stderr\n")
        console.phase("[x] training")
    assert capsys.readouterr().err == "[x] training\n"
    text = log.read_text()
    assert "a library's print\n" in text and "native stderr\n" in text and "[x] training" not in text


@pytest.mark.parametrize(
    "argv",
    [
        ["prepare", "C.yaml", "--limit", "40", "method=clozemath", "data.seed=1"],
        ["prepare", "C.yaml", "method=clozemath", "--limit", "40", "data.seed=1"],
        ["prepare", "--limit", "40", "C.yaml", "method=clozemath", "data.seed=1"],
    ],
)
def test_overrides_come_before_or_after_flags(argv: list[str]) -> None:
    args = parse_args(build_parser(), argv)
    assert (args.config, args.limit, args.overrides) == ("C.yaml", 40, ["method=clozemath", "data.seed=1"])


@pytest.mark.parametrize("argv", [["prepare", "C.yaml", "--bogus"], ["score", "p.jsonl", "method=base"]])
def test_other_stray_arguments_are_still_refused(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(build_parser(), argv)
    assert "unrecognized arguments" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------
# `clozemath run` end to end, its console as a person reads it (slow)

OURS = re.compile(
    r"(ray: |\[smoke\] |== smoke: |  smoke  |\| "
    r"|(loss|sample|adapter|predictions|MLflow|note|logs|traceback|tune|browse): |clozemath: error: |warning: )"
)
"""How every line of ours starts: phases and bars, the summary block, our warnings, the one-line error."""
BAR = re.compile(r"^(\[smoke\] (?:training|eval \w+)) (\d+)/(\d+) \[[#.]{20}\]")


def bars_once(lines: list[str]) -> list[str]:
    """The console with each progress bar's lines counted once (as its last line)."""
    kept: list[str] = []
    for line in lines:
        bar = BAR.match(line)
        if bar and kept and BAR.match(kept[-1]) and BAR.match(kept[-1]).group(1) == bar.group(1):
            kept[-1] = line
        else:
            kept.append(line)
    return kept


def summary_value(lines: list[str], key: str) -> str:
    (value,) = [line.removeprefix(f"{key}:").strip() for line in lines if line.startswith(f"{key}:")]
    return value


def assert_ours_only(lines: list[str]) -> None:
    assert lines and len(lines) < MAX_CONSOLE_LINES, "\n".join(lines)
    strangers = [line for line in lines if not OURS.match(line)]
    assert not strangers, "\n".join(lines)


@pytest.mark.slow
def test_the_smoke_run_console_is_short_ordered_and_summarised_with_the_rest_in_log_files(smoke_run: SmokeRun) -> None:
    code, lines, tmp_path = smoke_run.code, smoke_run.lines, smoke_run.folder
    console_text = "\n".join(lines)
    assert code == 0, console_text
    shown = bars_once(lines)
    assert_ours_only(shown)
    assert BAR.match(shown[shown.index(next(l for l in shown if "training 8/8" in l))]).group(2, 3) == ("8", "8")

    milestones = ["ray: started on this machine", "[smoke] preparing data: gsm8k/train", "[smoke] data: ",
                  "[smoke] loading the model (tiny-llama) on cpu", "[smoke] training 8/8 ", "[smoke] evaluating: gsm8k",
                  "[smoke] eval gsm8k 4/4 ", "== smoke: 1 of 1 trials finished ==", "| gsm8k | greedy |",
                  "loss:", "sample:", "adapter:", "MLflow:", "note:", "logs:", "browse: "]
    found = [next((i for i, line in enumerate(shown) if line.startswith(m)), None) for m in milestones]
    assert None not in found and found == sorted(found), list(zip(milestones, found))
    assert len([line for line in shown if line.startswith("[smoke] loading the model (tiny-llama) on cpu")]) == 2
    assert "from the cache" in next(line for line in shown if line.startswith("[smoke] data: "))

    loss = re.fullmatch(r"([\d.]+) -> ([\d.]+), falling \(the mean of its first and of its last 1 of 8 steps\)",
                        summary_value(shown, "loss"))  # the smoke run learns (`LEARNS`)
    assert loss and float(loss.group(2)) < float(loss.group(1))
    assert re.fullmatch(r'gsm8k \S+ \(greedy\): ".*" -> .* \(gold \S+\): (right|wrong).*', summary_value(shown, "sample"))
    adapter = Path(summary_value(shown, "adapter"))
    assert (adapter / "adapter_config.json").is_file() and adapter == tmp_path / "runs" / "smoke" / "adapter"
    run_id = re.fullmatch(r"run (\w+) \(experiment 'smoke'\)", summary_value(shown, "MLflow")).group(1)
    (run,) = tracking.find_runs(TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="smoke"),
                                {"role": "trial"})
    assert (run.info.run_id, run.info.status) == (run_id, "FINISHED")
    assert summary_value(shown, "browse") == (  # the runs table, on the view of the trials (tests/test_mlflow_view.py)
        f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlruns.db'}, then open http://127.0.0.1:5000/"
        "#/experiments/1/runs?workflowType=machine_learning&viewStateShareKey=clozemath-smoke")

    logs = tmp_path / "runs" / "smoke" / "logs"
    assert summary_value(shown, "logs").startswith(str(logs))
    driver, workers = (logs / "driver.log").read_text(), (logs / "workers.log").read_text()
    assert "Started a local Ray instance" in driver  # Ray's own lines on the driver
    assert "(RayTrainWorker pid=" in workers and "(run_trial pid=" in workers  # the trial's and the workers'
    assert "Setting accelerator to CPU" in workers  # DeepSpeed, in a training worker
    assert json.loads(workers.split(console.MARKER, 1)[1].splitlines()[0])["kind"] == "phase"


@pytest.mark.slow
def test_a_trial_failing_on_a_user_mistake_ends_the_console_with_one_line_and_where_its_log_is(
    smoke_run: SmokeRun, tmp_path: Path
) -> None:
    """A mistake only the trial can find (its training set, 22 samples, cannot fill one micro-batch of 500). The
    samples come from the smoke run's cache (the micro-batch size is not part of its key): what is tested here comes
    after them."""
    shutil.copytree(smoke_run.folder / "runs" / "cache", tmp_path / "runs" / "cache")
    code, lines = run_smoke(tmp_path, *LEARNS, "train.micro_batch_size=500", "eval.sets=[]")
    assert any(line.startswith("[smoke] data: ") and "from the cache" in line for line in lines), "\n".join(lines)
    assert code == 2, "\n".join(lines)
    assert_ours_only(bars_once(lines))
    assert lines[-1].startswith("clozemath: error: 1 of 1 trials failed; smoke: too few training samples: 0 micro-batches")
    assert not any("Traceback" in line for line in lines)
    logs = Path(summary_value(lines, "logs").split(" (")[0])
    assert logs == tmp_path / "runs" / "smoke" / "logs" and (logs / "driver.log").is_file()
    run_id = re.fullmatch(r"run (\w+) \(experiment 'smoke'\)", summary_value(lines, "MLflow")).group(1)
    (run,) = tracking.find_runs(TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="smoke"),
                                {"role": "trial"})
    assert (run.info.run_id, run.info.status) == (run_id, "FAILED")
    traceback = Path(summary_value(lines, "traceback"))
    assert "ClozeMathError: too few training samples" in traceback.read_text() and 'File "' in traceback.read_text()


def test_a_method_beside_its_base_model_closes_side_by_side_with_each_ones_evidence(plain_console, tmp_path: Path
                                                                                    ) -> None:
    """The quickstart's shape (a trained method and the base model, one seed): their rows in one table, the trained
    one's loss, a sample answer of each, and why one seed cannot tell them apart."""
    from clozemath.eval.predictions import Prediction, write_predictions
    from clozemath.records import ADAPTER_DIR, PREDICTIONS_ARTIFACTS
    from ray_jobs.grid import GridOutcome, TrialOutcome, print_grid_outcome

    store = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="quickstart")
    trials = []
    for name, correct, losses in (("method=clozemath_causal", 2, [2.0, 1.8, 1.2, 1.0, 0.9]), ("method=base", 1, [])):
        run = tracking.start_run(store, name)
        for step, loss in enumerate(losses, 1):
            run.log_metrics(step, {"train/loss": loss})
        folder = tmp_path / name
        if losses:
            (folder / ADAPTER_DIR).mkdir(parents=True)
        answer = Prediction(id="gsm8k-test-0", dataset="gsm8k", decoding="greedy", prompt="Q", generation="6 * 3 = 18\n"
                            "#### 18", extracted="18", gold="18", correct=True, confidence=None, finish_reason="eos")
        (folder / PREDICTIONS_ARTIFACTS).mkdir(parents=True)
        silent = Prediction(id="gsm8k-test-1", dataset="gsm8k", decoding="greedy", prompt="Q", generation=" \n",
                            extracted=None, gold="7", correct=False, confidence=None, finish_reason="stop")
        write_predictions(folder / PREDICTIONS_ARTIFACTS / "gsm8k.jsonl", [silent, answer])  # the first says nothing
        metrics = {"eval/gsm8k/greedy/accuracy": correct / 50, "eval/gsm8k/greedy/correct": correct,
                   "eval/gsm8k/greedy/total": 50, "eval/gsm8k/greedy/cut_share": 0.0}
        trials.append(TrialOutcome(name, "TERMINATED", run.run_id, metrics, folder=folder,
                                   headline="eval/gsm8k/greedy/accuracy"))
    print_grid_outcome(GridOutcome("quickstart", "parent", store.uri, "quickstart", tmp_path, trials, False))
    lines = plain_console[0].getvalue().splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert table[2:] == ["| method=clozemath_causal | gsm8k | greedy | 2 | 50 | 4.00% | 0.0% | - |",
                         "| method=base | gsm8k | greedy | 1 | 50 | 2.00% | 0.0% | - |"]
    assert [line for line in lines if line.startswith("loss:")] == [
        "loss:         method=clozemath_causal: 2.000 -> 0.900, falling (the mean of its first and of its last 1 of "
        "5 steps)"]  # the base model trains nothing: no loss line of its own
    samples = [line for line in lines if line.startswith("sample:")]
    assert [line.split(":")[1].strip() for line in samples] == ["method=clozemath_causal", "method=base"]
    assert all(line.endswith('"6 * 3 = 18 #### 18" -> 18 (gold 18): right') for line in samples)
    assert any(line.startswith("note:") and "clozemath report" in line for line in lines)
    assert any(line.startswith("tables:       clozemath report --experiment quickstart") for line in lines)
