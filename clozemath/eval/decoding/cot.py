"""CoT-decoding (Wang & Zhou 2024): branch on the top-k first tokens, continue every branch greedily in the same
batch (each branch's row starting from its prompt's cache), score each branch by the mean margin p(top-1) - p(top-2)
over its answer tokens, and pick the answer with the largest summed score.

Answer tokens are the tokens whose characters overlap the answer's character span in the text (`answer_span`), the
offsets coming from decoding token by token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from clozemath.errors import ClozeMathError
from clozemath.eval.decoding.job import Job
from clozemath.eval.decoding.rows import RowDecoding
from clozemath.eval.decoding.settings import AnswerSpan, DecodeSettings
from clozemath.eval.decoding.tokens import Generation, Row, top2_margin, without_padding


class CoTDecoding(RowDecoding):
    """`cot_k` branches a prompt (at most the tokenizer's ids), adjacent, in the order of their first token's
    probability (the first is greedy); the prompt's generation is the chosen branch's, with every branch."""

    margins = True

    def check(self, settings: DecodeSettings) -> None:
        if settings.answer_span is None:
            raise ClozeMathError("decode: CoT-decoding needs answer_span")

    def copies(self, settings: DecodeSettings, vocab: int) -> int:
        return min(settings.cot_k, vocab)

    def first(self, logits: torch.Tensor, job: Job) -> tuple[torch.Tensor, torch.Tensor | None]:
        margins = top2_margin(logits).repeat_interleave(job.copies)
        return without_padding(logits, job.stops).topk(job.copies, dim=-1).indices.flatten(), margins

    def generation(self, rows: Sequence[Row], job: Job) -> Generation:
        answer_span = job.settings.answer_span
        assert answer_span is not None
        return _aggregate([_branch(row, answer_span) for row in rows], job.settings.normalize_answer)


COT = CoTDecoding()


def _answer_confidence(row: Row, span: tuple[int, int]) -> float | None:
    """Mean margin over the tokens whose characters overlap `span`."""
    start, end = span
    assert row.margins is not None
    margins = [
        margin
        for margin, token_start, token_end in zip(row.margins, [0, *row.stream.ends], row.stream.ends)
        if token_start < end and token_end > start
    ]
    return sum(margins) / len(margins) if margins else None


def _branch(row: Row, answer_span: AnswerSpan) -> Generation:
    branch = row.generation()
    span = answer_span(branch.text, branch.finish_reason != "length")
    if span is not None:
        branch.answer = branch.text[span[0] : span[1]]
        branch.confidence = _answer_confidence(row, span)
    return branch


def _aggregate(branches: list[Generation], normalize: Callable[[str], str]) -> Generation:
    """The answer with the largest summed confidence; its most confident branch. Ties: the earlier branch."""
    totals: dict[str, float] = {}
    for branch in branches:
        if branch.answer is not None and branch.confidence is not None:
            key = normalize(branch.answer)
            totals[key] = totals.get(key, 0.0) + branch.confidence
    if not totals:
        greedy = branches[0]
        return Generation(greedy.text, greedy.token_ids, greedy.finish_reason, branches=branches)
    winner = max(totals, key=totals.__getitem__)
    chosen = max(
        (b for b in branches if b.answer is not None and b.confidence is not None and normalize(b.answer) == winner),
        key=lambda b: b.confidence,
    )
    return Generation(
        chosen.text, chosen.token_ids, chosen.finish_reason, answer=chosen.answer, confidence=totals[winner],
        branches=branches,
    )
