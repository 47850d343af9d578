"""`bench/vllm_baseline.py`'s scripting of vLLM, against a fake `LLM` that answers as vLLM's offline API does (its
outputs' `token_ids` and per-step `logprobs` dicts of `Logprob`s; `TokensPrompt` a dict), with what vLLM itself would
need replaced by small stand-ins: no vLLM here (it runs on the GPU machine only)."""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("bench_vllm_baseline", ROOT / "bench" / "vllm_baseline.py")
baseline = importlib.util.module_from_spec(SPEC)
sys.modules["bench_vllm_baseline"] = baseline  # its dataclasses look their module up
SPEC.loader.exec_module(baseline)


@dataclass
class SamplingParams:
    temperature: float
    max_tokens: int
    logprobs: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] | None = None


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int


@dataclass
class Logprob:
    logprob: float


@pytest.fixture(autouse=True)
def vllm(monkeypatch) -> None:
    """The names the baseline imports from vLLM (`TokensPrompt` is a TypedDict there: calling it makes a dict)."""
    module, inputs, sampling = (types.ModuleType(name) for name in ("vllm", "vllm.inputs", "vllm.sampling_params"))
    module.SamplingParams = SamplingParams
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    sampling.BeamSearchParams = BeamSearchParams
    for name, value in (("vllm", module), ("vllm.inputs", inputs), ("vllm.sampling_params", sampling)):
        monkeypatch.setitem(sys.modules, name, value)


def completion(token_ids: list[int], logprobs: list[dict[int, float]] | None = None) -> Any:
    steps = [{token: Logprob(value) for token, value in step.items()} for step in logprobs or []]
    return types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=token_ids, logprobs=steps)])


class FakeLLM:
    """Answers each `generate` call from the table its test gives: a prompt's ids (a tuple) to (tokens, logprobs)."""

    def __init__(self, answers: dict[tuple[int, ...], tuple[list[int], list[dict[int, float]]]]) -> None:
        self.answers = answers
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    def generate(self, prompts: list[dict], params: SamplingParams, use_tqdm: bool) -> list[Any]:
        ids = [prompt["prompt_token_ids"] for prompt in prompts]
        self.calls.append((ids, params))
        return [completion(*self.answers[tuple(row)]) for row in ids]


DECODING = baseline.Decoding(max_new_tokens=4, stop_token_ids=(2,), stop=())
LN = math.log


def test_cot_branches_on_the_top_k_first_tokens_and_keeps_the_branch_of_highest_mean_margin() -> None:
    """The first call returns k logprobs and, as vLLM does, the sampled token's too (here a fourth, lower): the
    branches are the top 3 by logprob, best first; each is continued with 3 more tokens, top-2 logprobs a step; the
    answer is the branch whose margins p1 - p2 average highest, not the first token's best."""
    answers = {
        (5, 6): ([30], [{10: LN(0.2), 20: LN(0.5), 30: LN(0.25), 40: LN(0.05)}]),
        (5, 6, 20): ([7, 8, 2], [{7: LN(0.5), 9: LN(0.4)}, {8: LN(0.6), 9: LN(0.3)}, {2: LN(0.5), 3: LN(0.4)}]),
        (5, 6, 30): ([7, 8, 9], [{7: LN(0.9), 9: LN(0.1)}, {8: LN(0.8), 1: LN(0.1)}, {9: LN(0.7), 1: LN(0.2)}]),
        (5, 6, 10): ([3], [{3: LN(0.6), 4: LN(0.2), 2: LN(0.01)}]),
    }
    llm = FakeLLM(answers)
    tokens, chosen = baseline.cot(llm, [{"prompt_token_ids": [5, 6]}], DECODING, k=3)

    (first_ids, first_params), (branch_ids, branch_params) = llm.calls
    assert first_ids == [[5, 6]] and (first_params.max_tokens, first_params.logprobs) == (1, 3)
    assert branch_ids == [[5, 6, 20], [5, 6, 30], [5, 6, 10]]
    assert (branch_params.max_tokens, branch_params.logprobs, branch_params.temperature) == (3, 2, 0.0)
    assert branch_params.stop_token_ids == [2]
    assert tokens == (1 + 3) + (1 + 3) + (1 + 1)
    assert len(chosen) == 1 and chosen[0].first == 30 and chosen[0].token_ids == [7, 8, 9]
    assert chosen[0].score == pytest.approx(((0.9 - 0.1) + (0.8 - 0.1) + (0.7 - 0.2)) / 3)


def test_a_margin_uses_the_two_best_of_a_steps_logprobs_and_one_alone_counts_in_full() -> None:
    assert baseline._margin({4: Logprob(LN(0.1)), 5: Logprob(LN(0.6)), 6: Logprob(LN(0.3))}) == pytest.approx(0.3)
    assert baseline._margin({4: Logprob(LN(0.8))}) == pytest.approx(0.8)


def test_greedy_counts_what_each_prompt_generated() -> None:
    llm = FakeLLM({(1,): ([4, 5, 2], []), (1, 2, 3): ([6], [])})
    assert baseline.greedy(llm, [{"prompt_token_ids": [1]}, {"prompt_token_ids": [1, 2, 3]}], DECODING) == 4
    params = llm.calls[0][1]
    assert (params.temperature, params.max_tokens, params.logprobs, params.stop) == (0.0, 4, None, None)


def test_beam_counts_the_best_hypothesis_tokens_after_the_prompt_and_takes_a_batch_of_prompts_at_a_time() -> None:
    seen = {}

    class BeamLLM:
        def beam_search(self, prompts, params, concurrency_limit):
            seen.update(width=params.beam_width, tokens=params.max_tokens, limit=concurrency_limit)
            return [types.SimpleNamespace(sequences=[types.SimpleNamespace(tokens=p["prompt_token_ids"] + [9] * n)])
                    for p, n in zip(prompts, (3, 1))]

    prompts = [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3, 4, 5, 6]}]
    assert baseline.beam(BeamLLM(), prompts, DECODING, beams=5, concurrency=64) == 4
    assert seen == {"width": 5, "tokens": 4, "limit": 64}


def test_the_engines_rows_are_the_batch_times_the_most_rows_a_prompt_takes() -> None:
    assert baseline.rows_per_prompt(["greedy"], 5, 9) == 1
    assert baseline.rows_per_prompt(["greedy", "beam"], 5, 9) == 5
    assert baseline.rows_per_prompt(["beam", "cot"], 5, 9) == 9


@pytest.mark.parametrize("argv", [["--schemes", "greedy,sample"], ["--batch-size", "0"], ["--max-new-tokens", "1"]])
def test_bad_arguments_stop_with_a_usage_error(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        baseline.parse_args(argv)
    assert stopped.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_random_shape_is_written_as_the_config_and_tokenizer_vllm_reads_with_dummy_weights(tmp_path: Path) -> None:
    """vLLM picks its model class by the written config's architecture and sizes its embedding from it: it must hold
    the vocabulary with our special tokens (the prompts' `<SEP>` among them); no weights for a random model."""
    from transformers import AutoConfig, AutoTokenizer

    prepared = baseline.prepare("tiny-llama", None, 3, 8, tmp_path)
    config, tokenizer = AutoConfig.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert prepared.dummy and prepared.folder == str(tmp_path) and len(prepared.ids) == 3
    assert not list(tmp_path.glob("*.safetensors"))
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.vocab_size >= len(tokenizer) > max(max(row) for row in prepared.ids)
    assert prepared.decoding == baseline.Decoding(8, (tokenizer.eos_token_id,), ())
