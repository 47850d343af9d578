"""A run's training data: the preprocessing steps (problems -> samples -> balanced copies -> token ids) that
`ray_jobs.preprocess` runs on Ray Data, and the same steps on one machine, which `clozemath prepare` shows."""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, TextIO

from transformers import PreTrainedTokenizerBase

from clozemath.config import DataConfig, ExperimentConfig, MethodConfig
from clozemath.data import objectives, samples, segment, sources, tokenize
from clozemath.data.objectives import TokenOffsets, balance, build_samples, lm_repeats, needs_offsets
from clozemath.data.samples import Sample
from clozemath.data.sources import Problem, load_problems
from clozemath.data.tokenize import (
    SpecialTokens,
    decode_with_names,
    encode_samples,
    install_special_tokens,
    num_sentinels_needed,
    token_offsets,
)
from clozemath.errors import ClozeMathError

def sample_modules() -> list[ModuleType]:
    """Every module that decides what a sample's token ids are: the problems' reading, segmentation, the objectives
    (registered ones included), tokenization and these steps."""
    return [sources, segment, samples, *objectives.source_modules(), tokenize, sys.modules[__name__]]


def sample_code() -> dict[str, str]:
    """A hash of each `sample_modules` module's source, by module: part of a run's identity (`clozemath.records`),
    so that a change names the module."""
    return {module.__name__: hashlib.sha256(inspect.getsource(module).encode()).hexdigest()[:16]
            for module in sample_modules()}


# --------------------------------------------------------------------------------------------------------------
# The steps: `ray_jobs.preprocess` maps them over Ray Data, `prepare_data` runs them here, so what `clozemath
# prepare` shows is what a run trains on. Rows are plain dicts (Ray Data's rows).

SENTINELS = "sentinels"
"""The column `problem_samples` adds: the sentinels a sample needs (their maximum sizes the special tokens)."""


def problem_samples(
    row: dict[str, Any], method: MethodConfig, prompt_template: str, seed: int, max_length: int,
    offsets: TokenOffsets | None,
) -> list[dict[str, Any]]:
    """Step 1 (a flat map over problems): a problem's samples, unbalanced, each with the sentinels it needs.
    `offsets`: the tokenizer's, for methods that draw random spans over tokens (else None)."""
    if seed is None:
        raise ClozeMathError("data.seed is unset (an experiment sets it from train.seed)")
    samples = build_samples(Problem(**row), method, prompt_template, seed, offsets, max_length)
    return [{**sample.to_dict(), SENTINELS: num_sentinels_needed([sample])} for sample in samples]


def balanced_copies(row: dict[str, Any], repeats: float, seed: int) -> list[dict[str, Any]]:
    """Step 2 (a flat map over samples): the sample's copies (an LM sample's `lm_copies`; one of any other).
    `repeats`: `lm_repeats` of the kinds of all samples."""
    sample = Sample(**{key: value for key, value in row.items() if key != SENTINELS})
    return [copy.to_dict() for copy in balance([sample], repeats, seed)]


class SampleEncoder:
    """Step 3 (a map over batches of samples): token ids, with the special tokens installed once per encoder."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, eos_token: str | None, num_sentinels: int, max_length: int
    ) -> None:
        self.tokenizer = tokenizer
        self.specials = install_special_tokens(tokenizer, num_sentinels, eos_token)
        self.max_length = max_length

    def encode(self, samples: list[Sample]) -> list[dict[str, Any] | None]:
        """`encode_sample`'s result for each sample; None where it is longer than `max_length`."""
        return encode_samples(samples, self.tokenizer, self.specials, self.max_length)


# --------------------------------------------------------------------------------------------------------------
# The steps in this process (`clozemath prepare`)


def training_samples(
    problems: Iterable[Problem], method: MethodConfig, data: DataConfig, offsets: TokenOffsets | None = None
) -> list[Sample]:
    """Steps 1 and 2 here: the problems' samples, balanced, in problem order (each problem's LM copies first)."""
    rows = [
        sample for problem in problems
        for sample in problem_samples(
            problem.to_dict(), method, data.prompt_template, data.seed, data.max_length, offsets
        )
    ]
    repeats = lm_repeats(Counter(row["kind"] for row in rows), method.lm_share)
    return [Sample(**copy) for row in rows for copy in balanced_copies(row, repeats, data.seed)]


@dataclass
class PreparedData:
    num_problems: int
    samples: list[Sample]
    """Balanced: an LM sample appears once per copy."""
    encoded: list[dict[str, Any] | None]
    """`encode_sample`'s result for each sample; None where it is longer than data.max_length."""
    tokenizer: PreTrainedTokenizerBase
    specials: SpecialTokens

    def summary(self, max_length: int) -> dict[str, Any]:
        dropped = Counter(s.kind for s, e in zip(self.samples, self.encoded) if e is None)
        return {
            "problems": self.num_problems,
            "samples": dict(Counter(s.kind for s in self.samples)),
            "total": len(self.samples),
            "max_length": max_length,
            "dropped_for_length": dict(dropped),
            "sentinels_needed": num_sentinels_needed(self.samples),
            "special_tokens": self.specials.tokens,
            "special_tokens_added": self.specials.added,
        }


def prepare_data(config: ExperimentConfig, limit: int | None = None) -> PreparedData:
    """The run's preprocessing steps on this machine: problems -> samples -> balanced copies -> token ids."""
    from clozemath.model.load import load_tokenizer  # models and peft: not for Ray's preprocessing workers

    data, method = config.data, config.method
    problems = load_problems(data.dataset, data.split, data.path, limit if limit is not None else data.limit)
    tokenizer = load_tokenizer(config.model)
    offsets = token_offsets(tokenizer) if needs_offsets(method) else None
    samples = training_samples(problems, method, data, offsets)
    encoder = SampleEncoder(tokenizer, config.model.eos_token, num_sentinels_needed(samples), data.max_length)
    return PreparedData(len(problems), samples, encoder.encode(samples), tokenizer, encoder.specials)


def _shown(prepared: PreparedData, show: int) -> list[dict[str, Any]]:
    """The first `show` distinct samples kept for training, decoded from their token ids; copies counted."""
    rows = []
    for _, run in itertools.groupby(zip(prepared.samples, prepared.encoded), key=lambda pair: pair[0]):
        run = list(run)
        sample, encoded = run[0]
        if encoded is None:
            continue
        if len(rows) == show:
            break
        ids, cut = encoded["input_ids"], encoded["prefix_len"]
        rows.append({
            "problem_id": sample.problem_id,
            "kind": sample.kind,
            "copies": len(run),
            "tokens": len(ids),
            "prefix_len": cut,
            "prefix": decode_with_names(ids[:cut], prepared.tokenizer, prepared.specials),
            "target": decode_with_names(ids[cut:], prepared.tokenizer, prepared.specials),
        })
    return rows


def _print_summary(summary: dict[str, Any], out: TextIO) -> None:
    kinds = ", ".join(f"{kind} {n}" for kind, n in summary["samples"].items())
    dropped = ", ".join(f"{kind} {n}" for kind, n in summary["dropped_for_length"].items()) or "none"
    tokens = summary["special_tokens"]
    shown = list(tokens.items())
    if len(shown) > 4:  # the sentinels run in order: the first and the last say it all
        shown = [*shown[:3], ("...", "..."), shown[-1]]
    mapping = ", ".join(name if name == "..." else f"{name}={token}" for name, token in shown)
    print(f"problems: {summary['problems']}", file=out)
    print(f"samples: {kinds} (total {summary['total']}, LM copies included)", file=out)
    print(f"dropped for length (> {summary['max_length']} tokens): {dropped}", file=out)
    print(f"sentinels needed: {summary['sentinels_needed']}", file=out)
    how = "added to the tokenizer" if summary["special_tokens_added"] else f"mapped onto reserved tokens: {mapping}"
    print(f"special tokens: {how}", file=out)


def show_prepared(config: ExperimentConfig, limit: int | None, show: int, fmt: Literal["text", "jsonl"]) -> None:
    """Print samples as the model sees them, then a summary (JSONL: samples on stdout, summary as JSON on stderr)."""
    out = sys.stdout
    prepared = prepare_data(config, limit)
    rows = _shown(prepared, show)
    summary = prepared.summary(config.data.max_length)
    if fmt == "jsonl":
        for row in rows:
            print(json.dumps(row, ensure_ascii=False), file=out)
        print(json.dumps({"summary": summary}), file=sys.stderr)
        return
    for number, row in enumerate(rows, start=1):
        print(
            f"=== {number}. {row['problem_id']}  {row['kind']}  x{row['copies']}  "
            f"{row['tokens']} tokens (prefix {row['prefix_len']})",
            file=out,
        )
        print(f"--- prefix\n{row['prefix']}\n--- target\n{row['target']}\n", file=out)
    _print_summary(summary, out)
