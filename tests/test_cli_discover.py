"""The commands a newcomer finds and finishes with (issue 48): `--version`, the top-level help, `ls`, `config`,
`generate` (ask a trained adapter) and `export` (the adapter merged into a Hugging Face folder)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from clozemath.eval.ask import ask
from clozemath.eval.evaluate import load_evaluated_model
from clozemath.model.load import load_model, save_adapter
from clozemath.plan import load_config
from clozemath_cli import main

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "experiments" / "smoke.yaml"
QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_version_and_a_help_that_shows_the_way_in(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("clozemath 0.")
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for command in ("ls", "config", "run", "report", "generate", "export"):
        assert f"\n    {command} " in text
    assert "getting started:" in text and "ray job submit" in text


def test_ls_names_what_the_registries_and_config_folders_hold(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["ls"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert {"clozemath", "mft", "it", "base"} <= set(lines["methods (" + str(ROOT / "configs" / "methods") + "/)"]
                                                     .split(", "))
    assert lines["decodings"] == "greedy, beam, cot" and lines["training-sets"] == "gsm8k, math"
    assert "replication_matched" in lines["grids (" + str(ROOT / "configs" / "grids") + "/)"]
    assert main(["ls", "eval-sets"]) == 0
    assert capsys.readouterr().out == "eval-sets: gsm8k, math, gsm_symbolic, gsm_p1, gsm_p2\n"


def test_config_prints_the_resolved_experiment_and_a_grids_trials(capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["config", str(SMOKE), "train.lr=0.002", "method=mft"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["lr"] == 0.002 and printed["method"]["name"] == "mft"
    assert printed["model"]["name"] == "tiny-llama"  # the reference resolved into its file's settings
    assert main(["config", "configs/grids/smoke.yaml"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("grid smoke-grid: ") and len(lines) == 1 + int(lines[0].split()[2])
    assert main(["config", str(SMOKE), "train.lr=-1"]) == 2


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter on the smoke model, its trainable weights nudged away from the base (as a training would)."""
    config = load_config(SMOKE)
    trained = load_model(config.model, num_sentinels=2, device="cpu", training=True)
    with torch.no_grad():
        for parameter in trained.model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn_like(parameter))
    return save_adapter(trained.model, tmp_path_factory.mktemp("adapter"), trained.specials)


def test_generate_answers_in_the_format_the_run_trained_on(adapter: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ClozeMath trains with PrefixLM: its prompt ends with `<SEP>`; the base model is asked few-shot; the printed
    text is what `ask` returns (greedy: the same twice)."""
    overrides = [f"eval.adapter={adapter}", "eval.max_new_tokens=6"]
    config = load_config(SMOKE, overrides)
    (answer,) = ask(config, [QUESTION])
    assert answer.prompt == f"Question: {QUESTION}\nAnswer:<SEP>"  # a random tiny model: its text may be empty
    assert answer.finish_reason in ("eos", "stop", "length")
    (base,) = ask(load_config(SMOKE, ["method=base", "eval.max_new_tokens=6"]), [QUESTION])
    assert base.prompt.endswith(f"Question: {QUESTION}\nAnswer:") and base.prompt.count("Question:") == 6  # 5 shots
    assert main(["generate", str(SMOKE), *overrides, "-q", QUESTION, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"question: {QUESTION}\n{answer.generation.strip()}\nanswer: ")


def test_export_writes_a_merged_model_that_predicts_as_the_adapter_does(adapter: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    overrides = [f"eval.adapter={adapter}"]
    out = tmp_path / "merged"
    assert main(["export", str(SMOKE), *overrides, "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "special_tokens.json").is_file()
    assert list(out.glob("*.safetensors")) and not list(tmp_path.glob(".*"))  # renamed whole, nothing left beside
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    reference = load_evaluated_model(load_config(SMOKE, overrides), adapter, "cpu").model
    ids = torch.tensor([[1, 5, 9, 11, 3]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, reference(ids).logits, atol=1e-5)
    assert main(["export", str(SMOKE), *overrides, "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(SMOKE), "method=base", "--out", str(tmp_path / "base")]) == 2
    assert "trains no adapter" in capsys.readouterr().err


def test_commands_that_take_one_experiment_take_a_grids_one_trial(capsys: pytest.CaptureFixture[str]) -> None:
    """The quickstart is a grid (a method beside its base model): `generate`, `export` and `eval` take its one trained
    trial, or the trial its `axes.` overrides leave; more than one left is one line naming the axes to pick by."""
    from clozemath_cli import _one_experiment

    grid = str(ROOT / "configs" / "experiments" / "quickstart.yaml")
    trained = _one_experiment(grid, [], "generate")
    assert trained.method.trains and trained.method.name == load_config(grid).axes["method"][0]
    assert _one_experiment(grid, ["axes.method=base"], "eval").method.name == "base"
    smoke_grid = ROOT / "configs" / "grids" / "smoke.yaml"  # more than one trained trial: refused in one line
    axes = load_config(smoke_grid).axes
    assert main(["eval", str(smoke_grid), "axes.model=[tiny-llama]", "axes.dataset=[gsm8k]"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(f"a grid of 3 trials; `eval` takes one: pick it with axes.method=<one of: "
                          f"{', '.join(axes['method'])}>")  # the axes left with one value need no picking
    assert main(["generate", str(smoke_grid), "-q", QUESTION]) == 2
    assert "`generate` takes one: pick it with axes." in capsys.readouterr().err


def documented_commands() -> list[tuple[str, str]]:
    """Every `clozemath ...` line of a bash block in README.md and docs/ that names no placeholder (`<head>`, `CONFIG`,
    `[--flag]`), as (file, command), its comment and a continued line's tail left out."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in page.read_text().split("```bash")[1:]:
            for line in block.split("```")[0].splitlines():
                command = re.split(r"\s#\s", line)[0].strip()
                if command.startswith("clozemath ") and not any(mark in command for mark in ("<", "[-", "...", "\\",
                                                                                             "CONFIG", "PATH")):
                    found.append((page.name, command))
    return found


def test_every_documented_command_parses_and_its_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README and docs' commands work as printed: the command line parses, the config it names loads with its
    overrides (and picks one trial where the command takes one)."""
    import shlex

    from clozemath.plan import load_plan
    from clozemath_cli import _one_experiment, build_parser, parse_args

    monkeypatch.chdir(ROOT)
    commands = documented_commands()
    assert len(commands) >= 15 and any("quickstart.yaml axes.method=base" in c for _, c in commands)
    for page, command in commands:
        argv = shlex.split(command)[1:]
        args = parse_args(build_parser(), argv)  # argparse exits on a command it does not know
        config = getattr(args, "config", None)
        if config is None or not config.endswith(".yaml"):
            continue
        overrides = list(getattr(args, "overrides", []))
        assert load_plan(config, overrides).experiments, (page, command)
        if argv[0] in ("eval", "generate", "export", "prepare"):  # the commands that take one experiment
            _one_experiment(config, overrides, argv[0])
