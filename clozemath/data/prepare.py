"""A run's training data: the preprocessing steps (problems -> samples -> balanced copies -> token ids) that
`ray_jobs.preprocess` runs on Ray Data, and the same steps on one machine, which `clozemath prepare` shows."""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import itertools
import json
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, TextIO

from transformers import PreTrainedTokenizerBase

from clozemath.config import DataConfig, ExperimentConfig, MethodConfig, ModelConfig
from clozemath.data import objectives
from clozemath.data.objectives import TokenOffsets, balance, build_samples, lm_repeats, needs_offsets, sample_inputs
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

# --------------------------------------------------------------------------------------------------------------
# What a prepared training set depends on: the code that makes a sample, and the settings it reads

DATA_PACKAGE = "clozemath.data"


def _imported_data_modules(module: ModuleType) -> list[ModuleType]:
    """The `clozemath.data` modules that `module`'s source imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # a submodule imported by its name
    found = []
    for name in sorted(names):
        if not name.startswith(f"{DATA_PACKAGE}."):
            continue
        try:
            found.append(importlib.import_module(name))
        except ModuleNotFoundError:  # a function or class imported from a module, not a module
            continue
    return found


def sample_modules() -> list[ModuleType]:
    """Every module that decides what a sample's token ids are: these steps, the registered objectives'
    (`objectives.source_modules`) and every `clozemath.data` module they import, directly or through another (the
    problems' reading, the training sets and their segmentation rules, segmentation, tokenization), found in their
    source rather than listed by hand."""
    found: dict[str, ModuleType] = {}
    pending = [sys.modules[__name__], *objectives.source_modules()]
    while pending:
        module = pending.pop()
        if module.__name__ not in found:
            found[module.__name__] = module
            pending += _imported_data_modules(module)
    return [found[name] for name in sorted(found)]


def source_hashes(modules: Iterable[ModuleType]) -> dict[str, str]:
    """A hash of each module's source, by module name."""
    return {module.__name__: hashlib.sha256(inspect.getsource(module).encode()).hexdigest()[:16] for module in modules}


def sample_code() -> dict[str, str]:
    """`source_hashes` of `sample_modules`: part of a run's identity (`clozemath.records`), so that a change names the
    module, and of its preprocessing cache's key (`preprocessing_key`)."""
    return source_hashes(sample_modules())


def tokenizer_settings(model: ModelConfig) -> dict[str, Any]:
    from clozemath.model.tokenizer import local_files_identity  # the model floor, above data

    settings = {key: getattr(model, key) for key in ("path", "gguf_file", "tokenizer", "eos_token")}
    if model.gguf_chunks is not None:  # only then: the keys of earlier caches stay what they were
        settings["gguf_chunks"] = model.gguf_chunks.model_dump(mode="json", exclude={"cache_dir"})
    if files := local_files_identity(model):  # a tokenizer edited in place is another tokenizer
        settings["files"] = files
    return settings


def sample_settings(config: ExperimentConfig) -> list[dict[str, Any]]:
    """What a prepared training set depends on in a config besides its problems: what of the method and the seed
    reaches a sample (`sample_inputs`: IT, MFT and it_prefixlm share one set at every seed), the data settings that
    shape a sample, the tokenizer's settings."""
    data = config.data
    return [sample_inputs(config.method, data.seed), {"prompt_template": data.prompt_template,
                                                      "max_length": data.max_length},
            tokenizer_settings(config.model)]


def _sha256(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def preprocessing_key(config: ExperimentConfig, problems: list[Problem], code: Mapping[str, str]) -> str:
    """The key of a prepared training set in the preprocessing cache: a hash of everything its token ids depend on
    and nothing else: the problems, `sample_settings` and `code` (`sample_code`, with the source of the steps'
    runner where it is another module: `ray_jobs.preprocess`)."""
    return _sha256(
        _sha256(*(json.dumps(p.to_dict(), sort_keys=True) for p in problems)),
        *(json.dumps(part, sort_keys=True) for part in sample_settings(config)),
        json.dumps(code, sort_keys=True),
    )[:24]


def training_set_identity(config: ExperimentConfig) -> str:
    """`preprocessing_key`'s inputs as a config states them (the data settings name the problems; the code is this
    process's), with the cache's folder: two configs alike here prepare the same rows into one folder."""
    data = config.data.model_dump(mode="json", exclude={"seed"})
    return json.dumps([data, *sample_settings(config), config.train.output_dir], sort_keys=True)


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
    from clozemath.model.tokenizer import load_tokenizer  # the model floor, above data

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
