"""The evaluation job: sets on the real data, prompts, a tiny random Llama decoded and graded end to end, the
Ray Data job behind `clozemath eval` with an adapter saved here, and the throughput benchmark's CPU path."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError
import torch

from clozemath_cli import main
from clozemath.config import EvalSetConfig
from clozemath.data.objectives import build_samples
from clozemath.data.sources import load_problems
from clozemath.data.tokenize import encode_sample
from clozemath.errors import ClozeMathError
from clozemath.eval.evaluate import Prompting, build_prompts, eval_problems, evaluate_batch, prompting, resolve_adapter
from clozemath.eval.predictions import (
    Prediction,
    grade_generation,
    metrics,
    prediction_from_row,
    read_predictions,
    regrade,
    results_table,
    trials_results_table,
    write_predictions,
)
from clozemath.eval.decoding import DecodeSettings, decode
from clozemath.model.load import load_model, save_adapter
from clozemath.plan import load_config
from clozemath.tasks import grade
from clozemath.tasks.base import MARKED_RULES
from clozemath.tasks.gsm8k import GSM8K_STOP
from clozemath.tasks.harness import STRICT_MATCH, harness_verdicts

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "experiments" / "smoke.yaml"
DECODINGS = ("greedy", "beam", "cot")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def smoke():
    return load_config(SMOKE, ["eval.max_new_tokens=8", "eval.cot_k=3", "eval.num_beams=2"])


@pytest.fixture(scope="module")
def loaded(smoke):
    return load_model(smoke.model, 0, "cpu", training=False)


# --------------------------------------------------------------------------------------------------------------
# Sets


@pytest.mark.parametrize(
    ("dataset", "count", "first_id"),
    [("gsm8k", 1319, "gsm8k-test-0"), ("math", 5000, "math-test-0"), ("gsm_p2", 2500, "gsm_p2-0-0")],
)
def test_read_sets_hold_every_test_problem(dataset, count, first_id):
    problems = eval_problems(EvalSetConfig(dataset=dataset))
    assert len(problems) == count and problems[0].id == first_id
    assert len({p.id for p in problems}) == count
    assert all(p.dataset == dataset and p.answer for p in problems)


@pytest.mark.parametrize(("dataset", "templates"), [("gsm_symbolic", 100), ("gsm_p1", 100), ("gsm_p2", 50)])
def test_generated_sets_instantiate_every_template(dataset, templates):
    problems = eval_problems(EvalSetConfig(dataset=dataset, per_template=2, seed=3, generate=True))
    assert len(problems) == 2 * templates and all(p.dataset == dataset for p in problems)
    assert problems == eval_problems(EvalSetConfig(dataset=dataset, per_template=2, seed=3, generate=True))
    other_seed = eval_problems(EvalSetConfig(dataset=dataset, per_template=2, seed=4, generate=True))
    assert [p.question for p in problems] != [p.question for p in other_seed]
    assert all(grade("gsm8k", p.solution, p.answer).correct for p in problems)  # each solution's `####` is its gold


def test_subsets_are_seeded_and_keep_file_order():
    full = eval_problems(EvalSetConfig(dataset="gsm8k"))
    subset = eval_problems(EvalSetConfig(dataset="gsm8k", limit=50, seed=1))
    assert subset == eval_problems(EvalSetConfig(dataset="gsm8k", limit=50, seed=1))
    assert subset != eval_problems(EvalSetConfig(dataset="gsm8k", limit=50, seed=2))
    positions = [full.index(p) for p in subset]
    assert len(subset) == 50 and positions == sorted(positions) and positions != list(range(50))
    assert eval_problems(EvalSetConfig(dataset="gsm8k", limit=5000)) == full
    with pytest.raises(ValidationError, match="greater than or equal to 1"):  # the config refuses it at load
        EvalSetConfig(dataset="gsm8k", limit=0)


# --------------------------------------------------------------------------------------------------------------
# Prompts


def test_prompting_follows_the_method(smoke):
    assert prompting(smoke) == Prompting(False, "bidirectional", smoke.data.prompt_template)
    assert prompting(load_config(SMOKE, ["method=it"])).attention == "causal"
    assert prompting(load_config(SMOKE, ["eval.prompt_attention=causal"])).attention == "causal"
    base = prompting(load_config(SMOKE, ["method=base"]))
    assert base.few_shot and base.attention == "causal"
    assert prompting(load_config(SMOKE, ["eval.few_shot=true"])).few_shot


def test_fine_tuned_prompt_ids_are_the_training_prefix(loaded, smoke):
    """Token for token the prefix of each problem's LM training sample, as the training data path builds it."""
    problems = load_problems("gsm8k", "test", limit=20) + load_problems("math", "test", limit=10)
    prompts = build_prompts(problems, loaded, prompting(smoke))
    for problem, prompt in zip(problems, prompts):
        (lm,) = [s for s in build_samples(problem, smoke.method, smoke.data.prompt_template, 0) if s.kind == "lm"]
        encoded = encode_sample(lm, loaded.tokenizer, loaded.specials, max_length=100_000)
        assert prompt.ids == encoded["input_ids"][: encoded["prefix_len"]]
        assert prompt.text == lm.prefix == f"Question: {problem.question}\nAnswer:<SEP>"
    sep = loaded.specials.ids["<SEP>"]
    assert prompts[0].ids[0] == loaded.tokenizer.bos_token_id and prompts[0].ids[-1] == sep
    assert loaded.tokenizer.decode(prompts[0].ids[1:-1]) == f"Question: {problems[0].question}\nAnswer:"


def test_the_fine_tuned_prompt_follows_the_template(loaded):
    """`P<SEP>` with the run's `data.prompt_template`, whatever it is."""
    (problem,) = load_problems("gsm8k", "test", limit=1)
    (prompt,) = build_prompts([problem], loaded, Prompting(False, "causal", "Q: {question}\nA:"))
    assert prompt.text == f"Q: {problem.question}\nA:<SEP>"


def test_few_shot_prompts_are_the_harness_ones(loaded, smoke):
    gsm, math = load_problems("gsm8k", "test", limit=1)[0], load_problems("math", "test", limit=1)[0]
    gsm_prompt, math_prompt = build_prompts([gsm, math], loaded, prompting(load_config(SMOKE, ["method=base"])))
    first_shot = load_problems("gsm8k", "train")[6374]  # the harness's first draw for test document 0
    assert gsm_prompt.text.startswith(f"Question: {first_shot.question}\nAnswer: {first_shot.solution}\n\n")
    assert gsm_prompt.text.endswith(f"Question: {gsm.question}\nAnswer:") and gsm_prompt.text.count("Question:") == 6
    assert math_prompt.text.startswith("Problem:\n")
    assert math_prompt.text.endswith(f"Problem:\n{math.question}\n\nSolution:")
    assert gsm_prompt.ids == loaded.tokenizer(gsm_prompt.text)["input_ids"]


# --------------------------------------------------------------------------------------------------------------
# Decoding and grading on a tiny random Llama


def test_tiny_model_end_to_end(loaded, smoke, tmp_path):
    problems = eval_problems(smoke.eval.sets[0])
    assert len(problems) == 4
    predictions = [p for d in DECODINGS for p in evaluate_batch(loaded, problems, d, smoke.eval, prompting(smoke))]
    path = tmp_path / "predictions.jsonl"
    write_predictions(path, predictions)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 12 and set(rows[0]) == {
        "id", "dataset", "decoding", "prompt", "generation", "extracted", "gold", "correct", "confidence", "harness",
        "finish_reason", "generated_tokens", "rule", "lenient",
    }
    assert read_predictions(path) == predictions
    for decoding in DECODINGS:
        mine = [p for p in predictions if p.decoding == decoding]
        assert [(p.id, p.gold) for p in mine] == [(p.id, p.answer) for p in problems]
    for prediction in predictions:
        assert prediction.prompt.endswith("Answer:<SEP>") and prediction.generation
        graded = grade("gsm8k", prediction.generation, prediction.gold, ended=prediction.finish_reason != "length")
        assert (prediction.extracted, prediction.correct, prediction.rule, prediction.lenient) == (
            graded.extracted, graded.correct, graded.rule, graded.lenient)
        # CoT-decoding's vote (eval.cot_vote: marked): only branches with a `####` answer; none voted, the greedy one
        marked = prediction.rule in MARKED_RULES
        assert (prediction.confidence is not None) == (prediction.decoding == "cot" and marked)
        assert prediction.finish_reason in ("eos", "stop", "length") and prediction.generated_tokens >= 1
        if prediction.finish_reason == "length":
            assert prediction.generated_tokens == smoke.eval.max_new_tokens

    values = metrics(predictions)
    names = ("accuracy", "correct", "total", "cut_share", "strict_accuracy", "flexible_accuracy", "fallback_share",
             "lenient_accuracy")
    uncut = {f"eval/gsm8k/{p.decoding}/uncut_accuracy" for p in predictions if p.finish_reason != "length"}
    assert set(values) == {f"eval/gsm8k/{d}/{name}" for d in DECODINGS for name in names} | uncut
    assert all(values[f"eval/gsm8k/{d}/total"] == 4 for d in DECODINGS)
    for d in DECODINGS:
        mine = [p for p in predictions if p.decoding == d]
        assert values[f"eval/gsm8k/{d}/cut_share"] == sum(p.finish_reason == "length" for p in mine) / 4
    assert values["eval/gsm8k/greedy/accuracy"] == sum(p.correct for p in predictions[:4]) / 4


@pytest.mark.parametrize(("vote", "votes_for_the_last_number"), [("marked", False), ("any", True)])
def test_cot_decoding_votes_with_marked_answers_unless_told_otherwise(
    loaded, smoke, monkeypatch, vote, votes_for_the_last_number
):
    """The paper: CoT-decoding's answer tokens are "numerical tokens after the annotation string ####"; a branch that
    ends on a bare number votes only under `eval.cot_vote: any`."""
    seen = {}

    def fake_decode(model, tokenizer, prompts, decoding, settings, on_done=None, on_progress=None):
        seen["span"] = settings.answer_span
        return []

    monkeypatch.setattr("clozemath.eval.decoding.decode", fake_decode)
    config = load_config(SMOKE, ["eval.decodings=[cot]"] + ([] if vote == "marked" else [f"eval.cot_vote={vote}"]))
    assert config.eval.cot_vote == vote
    evaluate_batch(loaded, eval_problems(config.eval.sets[0])[:1], "cot", config.eval, prompting(config))
    assert seen["span"]("so 3 + 4 = 7\n#### 7") == (18, 19)  # the 7 after `#### `
    assert seen["span"]("so 3 + 4 = 7") == ((11, 12) if votes_for_the_last_number else None)


def test_each_prediction_says_which_rule_graded_it_and_the_metrics_split_strict_from_flexible():
    """Four fine-tuned generations: `#### 7` right (ended), a bare `12` that the fallback would take (right, but cut
    at max_new_tokens: wrong, lenient right), `#### 5` wrong (ended), no number (cut); two few-shot (harness) ones:
    `#### 5` right, a bare `9` right only to flexible-extract. By hand: fine-tuned accuracy 1/4, strict 1/4, lenient
    2/4, fallback 0 (the one it found was cut), cut 2/4, uncut accuracy 1/2 (of `#### 7`, `#### 5`); few-shot
    strict 1/2 (its accuracy, and its lenient one), flexible 2/2."""
    rows = [("a", "3 + 4 = 7\n#### 7", "7", "eos"), ("b", "so it is 12 and 12", "12", "length"),
            ("c", "#### 5", "6", "eos"), ("d", "I do not know", "3", "length")]
    shots = [("e", "Half of 10 is 5.\n#### 5", "5", "stop"), ("f", "It is 9", "9", "eos")]
    predictions = []
    for harness, decoding, group in ((False, "greedy", rows), (True, "beam", shots)):
        for id, generation, gold, finish in group:
            verdict = grade_generation("gsm8k", generation, gold, harness, ended=finish != "length")
            predictions.append(Prediction(id, "gsm8k", decoding, "", generation, verdict.extracted, gold,
                                          verdict.correct, None, verdict.harness, finish, 9, verdict.rule,
                                          verdict.lenient))
    assert [p.rule for p in predictions] == ["strict", "cut", "strict", "none", "strict", "none"]
    assert [p.correct for p in predictions] == [True, False, False, False, True, False]
    assert [p.lenient for p in predictions] == [None, True, None, None, None, None]
    assert [p.extracted for p in predictions] == ["7", "12", "5", None, "5", None]
    values = metrics(predictions)
    tuned = {k.removeprefix("eval/gsm8k/greedy/"): v for k, v in values.items() if k.startswith("eval/gsm8k/greedy/")}
    assert tuned == {"accuracy": 0.25, "correct": 1, "total": 4, "cut_share": 0.5, "uncut_accuracy": 0.5,
                     "fallback_share": 0.0, "strict_accuracy": 0.25, "flexible_accuracy": 0.25,
                     "lenient_accuracy": 0.5}
    few_shot = {k.removeprefix("eval/gsm8k/beam/"): v for k, v in values.items() if k.startswith("eval/gsm8k/beam/")}
    assert few_shot == {"accuracy": 0.5, "correct": 1, "total": 2, "cut_share": 0.0, "uncut_accuracy": 0.5,
                        "fallback_share": 0.0, "strict_accuracy": 0.5, "flexible_accuracy": 1.0,
                        "strict-match": 0.5, "flexible-extract": 1.0, "lenient_accuracy": 0.5}
    # a file from before the rule and the finish were recorded: only what it holds the inputs of, and its generations
    # regraded as having ended (nothing says they were cut)
    old = [replace(p, rule=None, finish_reason=None, lenient=None) for p in predictions[:4]]
    assert set(metrics(old)) == {"eval/gsm8k/greedy/accuracy", "eval/gsm8k/greedy/correct", "eval/gsm8k/greedy/total"}
    assert [p.rule for p in regrade(old)] == ["strict", "flexible", "strict", "none"]
    # regrading knows the cut: the same verdicts as at evaluation
    assert regrade(predictions[:4]) == predictions[:4]


def test_a_prediction_written_before_the_cut_rule_is_judged_by_it_when_read_back():
    """A row from a file of 2026-11 (no `lenient` field): a cut generation answered by the fallback was counted
    right; read back it is wrong, its old verdict kept as `lenient`. Compact exports (no generation) too: the rule
    and the finish it records are all that takes. Other rows, and rows that record `lenient`, are read as written."""
    row = {"id": "b", "dataset": "gsm8k", "decoding": "greedy", "extracted": "12", "gold": "12", "correct": True,
           "finish_reason": "length", "rule": "flexible", "generation": ""}
    old = prediction_from_row(row, "old.jsonl:1")
    assert (old.correct, old.rule, old.lenient) == (False, "cut", True)
    assert prediction_from_row({**row, "finish_reason": "eos"}, "old.jsonl:2").correct
    assert prediction_from_row({**row, "rule": "strict"}, "old.jsonl:3").correct
    assert prediction_from_row({**row, "lenient": None}, "new.jsonl:1").correct  # as written: not re-judged


def test_results_table_shows_the_cut_share_and_warns_above_a_fifth():
    values = {
        "eval/gsm8k/greedy/accuracy": 0.5, "eval/gsm8k/greedy/correct": 2, "eval/gsm8k/greedy/total": 4,
        "eval/gsm8k/greedy/cut_share": 0.25, "eval/gsm8k/beam/accuracy": 1.0, "eval/gsm8k/beam/correct": 4,
        "eval/gsm8k/beam/total": 4, "eval/gsm8k/beam/cut_share": 0.2, "eval/math/greedy/accuracy": 0.0,
        "eval/math/greedy/correct": 0, "eval/math/greedy/total": 1,
    }
    lines = results_table(values).splitlines()
    assert lines[0] == "| set | decoding | correct | total | accuracy | cut at max_new_tokens | problems/s |"
    assert lines[2:5] == [
        "| gsm8k | beam | 4 | 4 | 100.00% | 20.0% | - |",
        "| gsm8k | greedy | 2 | 4 | 50.00% | 25.0% | - |",
        "| math | greedy | 0 | 1 | 0.00% | - | - |",  # a predictions file from before finish_reason
    ]
    assert lines[5:] == [
        "warning: gsm8k/greedy: 25.0% of the generations ran to max_new_tokens (a model that loops, or "
        "eval.max_new_tokens too small)"
    ]


def test_trials_read_side_by_side_in_one_results_table():
    tuned = {"eval/gsm8k/greedy/accuracy": 0.04, "eval/gsm8k/greedy/correct": 2, "eval/gsm8k/greedy/total": 50,
             "eval/gsm8k/greedy/cut_share": 0.3}
    base = {"eval/gsm8k/greedy/accuracy": 0.02, "eval/gsm8k/greedy/correct": 1, "eval/gsm8k/greedy/total": 50,
            "eval/gsm8k/greedy/cut_share": 0.0, "train/loss": 1.5}
    lines = trials_results_table({"method=clozemath_causal": tuned, "method=base": base}).splitlines()
    assert lines[0].startswith("| trial | set | decoding | correct |") and lines[1].startswith("| --- | --- |")
    assert lines[2:4] == ["| method=clozemath_causal | gsm8k | greedy | 2 | 50 | 4.00% | 30.0% | - |",
                          "| method=base | gsm8k | greedy | 1 | 50 | 2.00% | 0.0% | - |"]
    assert lines[4:] == ["warning: method=clozemath_causal: gsm8k/greedy: 30.0% of the generations ran to "
                         "max_new_tokens (a model that loops, or eval.max_new_tokens too small)"]


def test_few_shot_generations_stop_at_the_harness_stops(loaded, smoke):
    problems = eval_problems(smoke.eval.sets[0])[:2]
    base = load_config(SMOKE, ["method=base", "eval.max_new_tokens=24"])
    for prediction in evaluate_batch(loaded, problems, "greedy", base.eval, prompting(base)):
        assert not any(stop in prediction.generation for stop in GSM8K_STOP)


def test_a_batch_mixing_sets_is_prompted_and_graded_per_set(loaded, smoke):
    problems = [*load_problems("math", "test", limit=2), *load_problems("gsm8k", "test", limit=2)]
    base = load_config(SMOKE, ["method=base", "eval.max_new_tokens=4"])
    predictions = evaluate_batch(loaded, problems, "cot", base.eval, prompting(base))
    assert [p.id for p in predictions] == [p.id for p in problems]
    assert [p.prompt.startswith("Problem:") for p in predictions] == [True, True, False, False]
    for prediction in predictions[:2]:
        graded = grade(prediction.dataset, prediction.generation, prediction.gold)
        assert (prediction.extracted, prediction.correct) == (graded.extracted, graded.correct)
        assert prediction.harness is None
    for prediction in predictions[2:]:  # few-shot GSM8K: the harness's filters grade it
        verdicts = harness_verdicts(prediction.generation, prediction.gold)
        assert (prediction.correct, prediction.harness) == (verdicts[STRICT_MATCH], verdicts)


# --------------------------------------------------------------------------------------------------------------
# Adapters and `clozemath eval`


def test_missing_adapter_is_a_one_line_error(tmp_path, capsys):
    cfg = load_config(SMOKE, [f"train.output_dir={tmp_path}"])
    with pytest.raises(ClozeMathError, match="smoke/adapter"):
        resolve_adapter(cfg)
    assert resolve_adapter(load_config(SMOKE, ["method=base"])) is None
    assert main(["eval", str(SMOKE), f"eval.adapter={tmp_path / 'nowhere'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nowhere" in err and err.startswith("clozemath: error: adapter")


@pytest.fixture(scope="module")
def adapter(smoke, tmp_path_factory) -> Path:
    """A LoRA adapter on the smoke model, its weights and special-token rows nudged away from the base."""
    trained = load_model(smoke.model, num_sentinels=2, device="cpu", training=True)
    with torch.no_grad():
        for name, parameter in trained.model.named_parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn_like(parameter))
    return save_adapter(trained.model, tmp_path_factory.mktemp("adapter"), trained.specials)


@pytest.mark.slow
def test_clozemath_eval_runs_on_ray_data_and_logs_to_mlflow(ray_session, adapter, tmp_path, capsys):
    from mlflow import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlruns.db'}"
    argv = [
        "eval", str(SMOKE), f"eval.adapter={adapter}", f"train.output_dir={tmp_path / 'runs'}", f"tracking.uri={store}",
        "eval.decodings=[greedy,cot]", "eval.max_new_tokens=6", "eval.cot_k=2",
        "eval.sets=[{dataset: gsm8k, limit: 4}, {dataset: gsm_p1, per_template: 1, limit: 3}]",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| gsm8k | cot |" in out and "| gsm_p1 | greedy |" in out

    (folder,) = (tmp_path / "runs" / "evals").glob("smoke-*/eval")  # a folder of its own, never the run's
    gsm8k = read_predictions(folder / "predictions" / "gsm8k.jsonl")
    gsm_p1 = read_predictions(folder / "predictions" / "gsm_p1.jsonl")
    assert [p.decoding for p in gsm8k] == ["greedy"] * 4 + ["cot"] * 4 and len(gsm_p1) == 6
    assert [p.id for p in gsm8k[:4]] == [p.id for p in eval_problems(EvalSetConfig(dataset="gsm8k", limit=4))]
    assert all(p.prompt.endswith("<SEP>") for p in gsm8k + gsm_p1)
    assert not list((folder / "predictions").glob("*.partial.jsonl"))
    values = json.loads((folder / "metrics.json").read_text())
    for name in ("gsm8k/greedy", "gsm8k/cot", "gsm_p1/greedy", "gsm_p1/cot"):
        assert values[f"eval/{name}/total"] == (4 if name.startswith("gsm8k") else 3)
        assert 0.0 <= values[f"eval/{name}/accuracy"] <= 1.0 and values[f"eval/{name}/problems_per_s"] > 0
    startup, decoding = values["eval/startup_s"], values["eval/decode_s"]  # the actor's start, then its decoding
    assert startup > 0 and decoding > 0 and startup + decoding == pytest.approx(values["eval/seconds"])

    mlflow = MlflowClient(tracking_uri=store)
    (run,) = mlflow.search_runs([mlflow.get_experiment_by_name("smoke").experiment_id])
    assert run.info.run_name == "smoke/eval" and run.info.status == "FINISHED"
    assert run.data.metrics["eval/gsm8k/greedy/accuracy"] == values["eval/gsm8k/greedy/accuracy"]
    assert run.data.metrics["eval/startup_s"] == startup and run.data.metrics["eval/decode_s"] == decoding
    assert run.data.params["eval.adapter"] == str(adapter)
    logged = {a.path for a in mlflow.list_artifacts(run.info.run_id, "eval/predictions")}
    assert logged == {"eval/predictions/gsm8k.jsonl", "eval/predictions/gsm_p1.jsonl"}


@pytest.mark.slow
def test_a_model_the_actor_cannot_load_is_a_one_line_error(ray_session, tmp_path, capsys):
    argv = [
        "eval", str(SMOKE), "method=base", "model.tokenizer=/nowhere/tokenizer", f"train.output_dir={tmp_path}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlruns.db'}",
    ]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "clozemath: error: tokenizer path '/nowhere/tokenizer': no such folder"


# --------------------------------------------------------------------------------------------------------------
# A scripted model: evaluation that must find right answers, and stops that must cut


def scripted_model(smoke, prompt_end: str, continuation: str, eos: bool = True):
    """The tiny model rewired into a bigram machine: after the last token of `prompt_end` it writes `continuation`
    (then its end-of-sequence token when `eos`), each token followed by the next whatever came before (attention and
    MLP outputs zeroed, one embedding direction per token)."""
    loaded = load_model(smoke.model, 0, "cpu", training=False)
    model, tokenizer = loaded.model, loaded.tokenizer
    chain = _ids(tokenizer, prompt_end)[-1:] + _ids(tokenizer, continuation) + ([tokenizer.eos_token_id] if eos else [])
    successor: dict[int, int] = {}
    for token, following in zip(chain, chain[1:]):
        assert successor.setdefault(token, following) == following, "a token with two successors"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings, head_rows = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        embeddings.zero_()
        head_rows.zero_()
        for direction, (token, following) in enumerate(successor.items()):
            embeddings[token, direction] = 1.0
            head_rows[following, direction] = 100.0
    return loaded


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_model_that_answers_seven_scores_exactly_the_problems_whose_answer_is_seven(smoke, tmp_path):
    rows = [("How many cats?", "3 + 4 = 7\n#### 7"), ("How many dogs?", "#### 8"), ("How many birds?", "#### 7"),
            ("How many fish?", "#### 12")]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    problems = eval_problems(EvalSetConfig(dataset="gsm8k", path=str(tmp_path)))
    sep = load_model(smoke.model, 0, "cpu", training=False).specials.tokens["<SEP>"]
    loaded = scripted_model(smoke, sep, " So it is seven.\n#### 7")
    for decoding in DECODINGS:
        predictions = evaluate_batch(loaded, problems, decoding, smoke.eval, prompting(smoke))
        assert [p.generation for p in predictions] == [" So it is seven.\n#### 7"] * 4, decoding
        assert [p.correct for p in predictions] == [True, False, True, False]
        values = metrics(predictions)
        assert (values[f"eval/gsm8k/{decoding}/accuracy"], values[f"eval/gsm8k/{decoding}/correct"]) == (0.5, 2)


def test_few_shot_generations_are_cut_at_the_harness_stops(smoke):
    """After `Answer:` the scripted model writes ` 7\n\nQuestion: 7\n\nQuestion: ...` (the few-shot prompt's next
    turn); the harness's stop sequences (v0.4.12: `Question:`, not a blank line) cut it right after its answer."""
    problems = eval_problems(smoke.eval.sets[0])[:2]
    base = load_config(SMOKE, ["method=base", "eval.max_new_tokens=24", "eval.num_beams=2", "eval.cot_k=3"])
    loaded = scripted_model(smoke, "Answer:", " 7\n\nQuestion:", eos=False)
    prompt = ["Question: 1+6?\nAnswer:"]
    (unstopped,) = decode(loaded.model, loaded.tokenizer, prompt, "greedy", DecodeSettings(max_new_tokens=12))
    assert unstopped.text.startswith(" 7\n\nQuestion: 7\n\nQuestion:")  # what the stops must cut
    for decoding in DECODINGS:
        for prediction in evaluate_batch(loaded, problems, decoding, base.eval, prompting(base)):
            assert prediction.generation == " 7\n\n" and prediction.finish_reason == "stop", (decoding, prediction)


# --------------------------------------------------------------------------------------------------------------
# The evaluation actor


def test_an_evaluation_actor_builds_its_model_once_for_every_set_decoding_and_batch(monkeypatch):
    """Ray Data's actor (here in this process): 2 sets x 2 decodings in 3 batches, one model built; each row says
    when the actor was ready to decode, which ends the evaluation's start-up."""
    import time

    import pyarrow as pa

    from clozemath.config import to_wire
    from clozemath.model import load
    from ray_jobs.eval_job import PACKED, Evaluator, unpacked

    builds = []
    build = load._random_model
    monkeypatch.setattr(load, "_random_model", lambda *args, **kwargs: builds.append(1) or build(*args, **kwargs))
    config = load_config(SMOKE, [
        "method=base", "eval.decodings=[greedy,beam]", "eval.num_beams=2", "eval.max_new_tokens=4",
        "eval.batch_size=2", "eval.sets=[{dataset: gsm8k, limit: 3}, {dataset: gsm_p1, limit: 2, per_template: 1}]",
    ])
    problems = [problem.to_dict() for set_cfg in config.eval.sets for problem in eval_problems(set_cfg)]
    before = time.time()
    actor = Evaluator(to_wire(config), None, cpu_threads=1)
    assert before <= actor.ready_at <= time.time()
    rows = []
    for batch in (problems[:2], problems[2:4], problems[4:]):  # the second mixes the sets
        for made in actor(pa.Table.from_pylist(batch)):  # the rows made since the last table, as they come
            assert made.schema == PACKED and made.num_rows == 1 and unpacked(made)
            rows += unpacked(made)
    assert len(builds) == 1
    assert sorted((row["dataset"], row["decoding"]) for row in rows) == sorted(
        (p["dataset"], decoding) for p in problems for decoding in ("greedy", "beam"))
    assert {row["ready_at"] for row in rows} == {actor.ready_at}


def test_an_actor_sends_its_rows_back_as_they_are_made_and_the_error_that_stops_it():
    """`as_made` (the actor's rows, from decoding's callbacks, as the generator Ray Data streams back): each row is
    yielded before the next is made (the maker waits for it to be taken), in order; an error ends the stream."""
    import threading

    from ray_jobs.eval_job import as_made

    taken = threading.Event()

    def make(take):
        for index in range(3):
            taken.clear()
            take([{"row": index}])
            assert taken.wait(timeout=60), "a row was not yielded before the next was made"

    got = []
    for rows in as_made(make):
        got.append(rows)
        taken.set()
    assert got == [[{"row": 0}], [{"row": 1}], [{"row": 2}]]

    def failing(take):
        take([{"row": 0}])
        raise ClozeMathError("the model could not decode")

    got = []
    with pytest.raises(ClozeMathError, match="could not decode"):
        for rows in as_made(failing):
            got += rows
    assert got == [{"row": 0}]  # the rows made before it, yielded first


def test_each_yield_of_an_evaluation_actor_comes_back_as_one_block_however_many_predictions_it_holds(ray_session):
    """In the evaluation's Ray Data context, each table an actor yields (the predictions it made since its last yield,
    `packed`) comes back as one block of its own: not sliced into one block a prediction (Ray's ~0.1 s a block then
    set the pace, the card idle), and not gathered with the others into one block at the batch's end (the bar would
    wait for it)."""
    import ray

    from ray_jobs.eval_job import SCHEMA, _evaluation_context, packed, unpacked

    yields, rows_a_yield = 30, 20  # 600 predictions of ~1 KiB
    row = dict.fromkeys(SCHEMA.names) | {"generation": "x" * 1024}

    def decode_as_it_goes(batch):
        ids = batch.column("id").to_pylist()
        for start in range(0, len(ids), rows_a_yield):
            yield packed([row | {"id": str(i)} for i in ids[start:start + rows_a_yield]])

    with _evaluation_context():
        dataset = ray.data.from_items([{"id": i} for i in range(yields * rows_a_yield)]).map_batches(
            decode_as_it_goes, batch_format="pyarrow", batch_size=yields * rows_a_yield)
        blocks = [[int(made["id"]) for made in unpacked(batch)]
                  for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow")]
    starts = range(0, yields * rows_a_yield, rows_a_yield)
    assert blocks == [list(range(start, start + rows_a_yield)) for start in starts]


def test_an_evaluations_seconds_split_into_its_start_up_and_its_decoding():
    from clozemath.eval.folder import startup_and_decoding

    assert startup_and_decoding(100.0, 130.0, 160.0) == {"eval/startup_s": 30.0, "eval/decode_s": 30.0}
    # an actor on a node whose clock runs behind or ahead: the start-up stays within the evaluation
    assert startup_and_decoding(100.0, 99.0, 160.0) == {"eval/startup_s": 0.0, "eval/decode_s": 60.0}
    assert startup_and_decoding(100.0, 170.0, 160.0) == {"eval/startup_s": 60.0, "eval/decode_s": 0.0}
