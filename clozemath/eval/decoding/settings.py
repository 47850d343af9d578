"""How `decode` decodes: one settings object for every decoding (each reads the fields it needs).

Light on purpose (no torch): `clozemath.eval.evaluate` builds it from an `EvalConfig` without importing the decoders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from clozemath.config import EvalConfig

PromptAttention = Literal["causal", "bidirectional"]
Engine = Literal["auto", "eager", "static", "graphs"]
ENGINES: tuple[Engine, ...] = ("auto", "eager", "static", "graphs")
AnswerSpan = Callable[[str, bool], "tuple[int, int] | None"]
"""`(text, ended) -> (start, end) | None`: where the answer of a branch's text is (`ended`: it was not cut at
`max_new_tokens`, a cut one may have none where an uncut one would)."""


@dataclass(frozen=True)
class DecodeSettings:
    """`batch_size` counts prompts (a batch holds `batch_size * num_beams` rows for beam search, `batch_size * cot_k`
    for CoT-decoding); "auto": as many as fit the GPU's free memory (`batching.auto_batch_size`), elsewhere
    `batching.cpu_batch_size`. `engine` "auto": CUDA graphs over a static cache on CUDA, the eager DynamicCache loop
    elsewhere; "static": the graph engine's steps run eagerly (its kernels without the graphs, for comparisons). With
    the static engines, greedy and CoT batches refill a prompt's rows once they have all ended (continuous batching:
    the tokens are the same). `prompt_attention="bidirectional"` encodes each whole prompt with bidirectional attention
    (PrefixLM). Beam search follows `model.generate(num_beams=..., length_penalty=..., early_stopping=...)`.
    CoT-decoding needs `answer_span(text, ended) -> (start, end) | None`; answers are compared after
    `normalize_answer`."""

    max_new_tokens: int = 512
    stop: Sequence[str] = ()
    """A row ends after the token that completes one of these strings (the text is cut before it)."""
    eos_token_ids: int | Sequence[int] | None = None
    """None: the tokenizer's and the model's generation config's."""
    prompt_attention: PromptAttention = "causal"
    batch_size: int | Literal["auto"] = "auto"
    num_beams: int = 5
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    cot_k: int = 9
    answer_span: AnswerSpan | None = None
    normalize_answer: Callable[[str], str] = str.strip
    add_special_tokens: bool = True
    """Text prompts only: encoded with the tokenizer's special tokens (BOS); token-id prompts decode as they are."""
    engine: Engine = "auto"

    @classmethod
    def of(cls, eval_cfg: EvalConfig, few_shot: bool, **fields: Any) -> DecodeSettings:
        """The settings an evaluation config gives every set (lengths, for a few-shot or a fine-tuned model's prompts;
        batch size, beams, branches), with `fields` (what a set or a caller adds: stop strings, the prompt's
        attention, CoT's answer rule, the engine)."""
        return cls(
            max_new_tokens=eval_cfg.new_tokens(few_shot), batch_size=eval_cfg.batch_size,
            num_beams=eval_cfg.num_beams, cot_k=eval_cfg.cot_k, **fields,
        )
