"""A run's training data on one machine: problems -> balanced samples -> token ids; `clozemath prepare` shows it."""

from __future__ import annotations

import itertools
import json
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal, TextIO

from transformers import PreTrainedTokenizerBase

from clozemath.config import ExperimentConfig
from clozemath.data.objectives import Sample, dataset_samples
from clozemath.data.sources import load_problems
from clozemath.data.tokenize import (
    SpecialTokens,
    decode_with_names,
    encode_samples,
    install_special_tokens,
    num_sentinels_needed,
    token_offsets,
)
from clozemath.model.load import load_tokenizer


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
    """Load the problems, build and balance the method's samples, install the special tokens, tokenize."""
    data = config.data
    problems = load_problems(data.dataset, data.split, data.path, limit if limit is not None else data.limit)
    tokenizer = load_tokenizer(config.model)
    samples = dataset_samples(problems, config.method, data, token_offsets(tokenizer))
    specials = install_special_tokens(tokenizer, num_sentinels_needed(samples), config.model.eos_token)
    encoded = encode_samples(samples, tokenizer, specials, data.max_length)
    return PreparedData(len(problems), samples, encoded, tokenizer, specials)


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
