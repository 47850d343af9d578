"""The decodings' registry: a decoding added through it alone (DEVELOPMENT.md's recipe "a decoding") decodes and is
graded end to end on CPU, as the built-in ones are; its names are known without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clozemath.errors import ClozeMathError
from clozemath.eval import decoding
from clozemath.eval.decoding import (
    DecodeSettings, Decoding, Generation, Job, decode, decoding_names, get_decoding, register,
)
from clozemath.eval.evaluate import build_prompts, eval_problems, evaluate_batch, prompting
from clozemath.model.load import load_model
from clozemath.plan import load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "experiments" / "smoke.yaml"
SHORT = DecodeSettings(max_new_tokens=2)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class FirstToken(Decoding):
    """The toy decoding: one step, each prompt's likeliest next token from its prompt pass alone."""

    def decode(self, job: Job, indices: list[int], size: int, engine: str, emit) -> None:
        for start in range(0, len(indices), size):
            batch = indices[start : start + size]
            _, logits = job.prefill(batch)
            for index, token in zip(batch, logits[:, : job.stops.vocab].argmax(dim=-1).tolist()):
                emit(index, Generation(job.tokenizer.decode([token], skip_special_tokens=True), [token], "length"))


@pytest.fixture
def first_token(monkeypatch):
    """"first-token" registered for one test (the registry as it was, after)."""
    monkeypatch.setattr(decoding.registry.DECODINGS, "_entries", dict(decoding.registry.DECODINGS._entries))
    return register("first-token", FirstToken())


@pytest.fixture(scope="module")
def smoke():
    return load_config(SMOKE, ["eval.prompt_attention=causal"])  # as the reference pass below attends


@pytest.fixture(scope="module")
def loaded(smoke):
    return load_model(smoke.model, 0, "cpu", training=False)


def next_token(loaded, ids: list[int]) -> int:
    """The prompt's likeliest next token of the tokenizer's (the model's rows past them only align its matrices), from
    one unbatched forward pass of its own."""
    with torch.no_grad():
        return int(loaded.model(torch.tensor([ids])).logits[0, -1, : len(loaded.tokenizer)].argmax())


@pytest.mark.usefixtures("first_token")
def test_a_registered_decoding_decodes_and_is_graded_end_to_end(loaded, smoke):
    assert decoding_names() == ("greedy", "beam", "cot", "first-token")
    problems = eval_problems(smoke.eval.sets[0])
    prompts = build_prompts(problems, loaded, prompting(smoke))
    firsts = [next_token(loaded, prompt.ids) for prompt in prompts]

    predictions = evaluate_batch(loaded, problems, "first-token", smoke.eval, prompting(smoke), engine="eager")
    assert [p.id for p in predictions] == [p.id for p in problems]
    assert all(p.decoding == "first-token" and p.finish_reason == "length" for p in predictions)
    assert [p.generated_tokens for p in predictions] == [1] * len(problems)
    assert [p.generation for p in predictions] == [
        loaded.tokenizer.decode([token], skip_special_tokens=True) for token in firsts
    ]
    assert not any(character.isdigit() for p in predictions for character in p.generation)  # graded: no number
    assert all(p.extracted is None and not p.correct and p.rule == "none" for p in predictions)
    ids = [prompt.ids for prompt in prompts]  # greedy's first tokens, batched and left-padded: the same
    assert [g.token_ids[0] for g in decode(loaded.model, loaded.tokenizer, ids, "greedy", SHORT)] == firsts


def test_an_unknown_decoding_is_one_line_naming_the_known_ones(loaded):
    with pytest.raises(ClozeMathError, match=r"unknown decoding 'first-token' \(known: greedy, beam, cot\)$"):
        decode(loaded.model, loaded.tokenizer, ["2 + 2 ="], "first-token")


def test_the_built_in_decodings_load_from_their_modules():
    assert [type(get_decoding(name)).__name__ for name in ("greedy", "beam", "cot")] == [
        "RowDecoding", "BeamSearch", "CoTDecoding",
    ]


def test_names_and_settings_come_without_torch():
    """Configs check decoding names and evaluation builds settings before anything heavy is imported."""
    code = ("import sys; from clozemath.eval.decoding import DecodeSettings, decoding_names; "
            "print(decoding_names(), DecodeSettings().engine, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["('greedy',", "'beam',", "'cot')", "auto", "False"]
