"""Training samples per objective: the objective registry (name -> sample builder), a problem's samples, balancing;
MFT noise in `mft` (on token ids, so imported from its module: this package loads without torch, and a config's
objective names are checked against `objective_names()` before anything heavy is imported).

An objective is one module (a builder: `Solution`, method, RNG -> samples, wrapped in an `Objective`) and one line in
`OBJECTIVES` below, or a `register` call: methods may then list it in `objectives`, `clozemath prepare` and a run's
preprocessing build its samples (balanced against LM like every objective but LM; the cache key hashes its module)
and count them under its name. Built in: `lm`, `cloze` (the paper's equation masking), `random_span`.

Text convention (one rule for every objective, so that methods differ in one thing only). With P the formatted
prompt (`Question: ...\\nAnswer:`) and Y the clean solution:

- LM sample:         prefix `P<SEP>`,     target ` Y<EOS>`
- infilling sample:  prefix `P Y'<SEP>`,  target `<M_0> a<M_1> b<EOS>`   (P and Y' joined by one space)

where Y' is Y, less GSM8K's closing `#### N` line (it would give the always-masked last equation's result away), with
each masked piece replaced by its sentinel (the whitespace around the piece stays in Y'), and a, b are the masked
pieces, each written after its sentinel with exactly one space, as the LM target writes Y after `<SEP>`. No other
whitespace is put next to a special token. A masked piece never has whitespace at its ends: an equation is masked
without the whitespace around it, a random span runs from a token's first visible character to a token's last one.
When tokenized, each name becomes its one token and the text between names is tokenized on its own
(`clozemath.data.tokenize`), so ` Y` and ` a` start with the tokenizer's word-initial tokens.

Randomness (which members of a group are masked, where random spans fall, which problems get an extra LM copy) comes
from a per-problem RNG derived from (seed, problem id, purpose; an objective's purpose is its name): the samples of a
problem do not depend on the order of the problems nor on how they are sharded.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from clozemath.config import MethodConfig
from clozemath.data.objectives.balance import balance, lm_copies, lm_repeats, objective_counts
from clozemath.data.objectives.base import Objective, Solution, TokenOffsets, infilling_sample, problem_rng
from clozemath.data.objectives.cloze import CLOZE
from clozemath.data.objectives.lm import LM, lm_sample
from clozemath.data.objectives.random_span import RANDOM_SPAN, visible_tokens
from clozemath.data.samples import Sample
from clozemath.data.segment import Segment, equation_units, segment_solution, without_final_answer
from clozemath.data.sources import Problem
from clozemath.errors import ClozeMathError
from clozemath.registry import Registry

__all__ = [
    "Objective", "Sample", "Solution", "TokenOffsets", "balance", "build_samples", "format_prompt",
    "get_objective", "infilling_sample", "lm_copies", "lm_repeats", "lm_sample", "needs_offsets",
    "objective_counts", "objective_names", "problem_rng", "register", "sample_inputs", "samples_from_segments",
    "source_modules", "visible_tokens",
]

OBJECTIVES: Registry[Objective] = Registry("objective", [(o.name, o) for o in (LM, CLOZE, RANDOM_SPAN)])
"""In the order a problem's samples come in (whatever the order of `method.objectives`)."""
objective_names = OBJECTIVES.names
get_objective = OBJECTIVES.__getitem__


def register(objective: Objective) -> Objective:
    """Make an objective known by its name (registering a name again replaces it)."""
    return OBJECTIVES.register(objective.name, objective)


def needs_offsets(method: MethodConfig) -> bool:
    """Whether one of the method's objectives works on the tokenizer's tokens."""
    return any(get_objective(name).needs_offsets for name in method.objectives)


def _check_trains(method: MethodConfig) -> None:
    if not method.trains:
        raise ClozeMathError(f"method '{method.name}' does not train: it has no training samples")


def _used(method: MethodConfig) -> list[Objective]:
    """The method's objectives, in registry order (the order its samples come in), each once."""
    wanted = {get_objective(name).name for name in method.objectives}
    return [objective for objective in OBJECTIVES.entries() if objective.name in wanted]


def sample_inputs(method: MethodConfig, seed: int | None) -> dict[str, Any]:
    """Exactly what of a method and a seed its training samples depend on (beside the problems, the data settings
    and the code): methods with equal `sample_inputs` train on the same samples, so a preprocessing cache key hashes
    this, not the whole method (IT, MFT and it_prefixlm share one set at every seed; clozemath and clozemath_causal
    one per seed).

    In: the objectives, as a set (samples come in registry order whatever order the method lists them in); the
    `MethodConfig` fields each objective's builder reads (`Objective.settings`: `random_span`'s span shapes, every
    field for a builder that does not say); `lm_share` and the seed where balancing can happen (more than one
    objective: with one, `lm_repeats` is 1 and every sample is kept once, whatever the seed); the seed where an
    objective draws from its RNG (`Objective.draws`: the cloze groups' halves, random spans; not LM).
    Out: `name` (messages only), `attention` (the mask a step trains with), `mft` (noise the training loop puts on
    the token ids, `clozemath.train.batches`), `trains` (a method that does not train has no samples: refused).
    """
    _check_trains(method)
    used = _used(method)
    balances = len(used) > 1
    inputs: dict[str, Any] = {"objectives": [objective.name for objective in used]}
    for objective in used:
        fields = None if objective.settings is None else set(objective.settings)
        inputs.update(method.model_dump(mode="json", include=fields))
    if balances:
        inputs["lm_share"] = method.lm_share
    if balances or any(objective.draws for objective in used):
        inputs["seed"] = seed
    return inputs


def source_modules() -> list[ModuleType]:
    """The modules that decide a sample's text: this package's and every registered objective's (a preprocessing
    cache key hashes their source)."""
    package = [sys.modules[name] for name in sorted(sys.modules) if name.startswith(f"{__name__}.")]
    builders = [sys.modules[objective.build.__module__] for objective in OBJECTIVES.entries()]
    return list(dict.fromkeys([sys.modules[__name__], *package, *builders]))


def format_prompt(template: str, question: str) -> str:
    try:
        return template.format(question=question)
    except (KeyError, IndexError, ValueError) as exc:
        raise ClozeMathError(f"data.prompt_template: cannot format it with a question ({exc!r})") from None


def samples_from_segments(
    problem_id: str,
    prompt: str,
    segments: Sequence[Segment],
    units: Sequence[Sequence[int]],
    method: MethodConfig,
    seed: int,
    token_offsets: TokenOffsets | None = None,
) -> list[Sample]:
    """The samples of each of the method's objectives, in registry order (an LM sample first, then the infilling
    ones: k of them for k units of F), unbalanced; random spans need the model tokenizer's `token_offsets`.

    Y is the segments joined, which segmentation guarantees to be the clean solution.
    """
    _check_trains(method)
    solution = Solution(problem_id, prompt, segments, without_final_answer(segments), units, token_offsets)
    return [
        sample
        for objective in _used(method)
        for sample in objective.build(solution, method, problem_rng(seed, problem_id, objective.name))
    ]


def build_samples(
    problem: Problem, method: MethodConfig, prompt_template: str, seed: int, token_offsets: TokenOffsets | None = None,
    max_length: int | None = None,
) -> list[Sample]:
    """A problem's samples before balancing (`clozemath.data.prepare.problem_samples`).

    With `max_length` (tokens), a solution with more units of F than that gets no infilling sample: none would fit,
    as each unit takes at least a token of its own (a sentinel, or its number), and k samples of k units each
    would take time and memory quadratic in k (a valid 5 MB row holds ~99,000 equations).
    """
    segments = segment_solution(problem.dataset, problem.solution)
    prompt = format_prompt(prompt_template, problem.question)
    units = equation_units(segments)
    if max_length is not None and len(units) > max_length:
        units = []
    return samples_from_segments(problem.id, prompt, segments, units, method, seed, token_offsets)
