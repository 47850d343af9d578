"""Beam search as transformers' `generate(num_beams=...)` does it (same scores, tie-breaks and stopping rule).

Beam search keeps its batches (a batch ends when its last item does) and its bookkeeping on the device: on the static
engine the host looks for done items only every `sync_every` steps.
"""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedTokenizerBase

from clozemath.eval.decoding.eager import KVBatch
from clozemath.eval.decoding.job import Decoding, Emit, Job, RunEngine, batches
from clozemath.eval.decoding.settings import DecodeSettings
from clozemath.eval.decoding.static import SharedPromptBatch
from clozemath.eval.decoding.tokens import Generation, Stops, first_stop, without_padding

_NEG = -1.0e9
"""The score that takes a beam out of the running (transformers' constant, for identical tie-breaks)."""


class BeamSearch(Decoding):
    """`num_beams` rows a prompt; `length_penalty` and `early_stopping` as `generate` takes them."""

    shares_prompt = True

    def copies(self, settings: DecodeSettings, vocab: int) -> int:
        return settings.num_beams

    def decode(self, job: Job, indices: list[int], size: int, engine: RunEngine, emit: Emit) -> None:
        for batch_indices in batches(indices, size):
            for index, generation in zip(batch_indices, _search_batch(job, batch_indices, engine)):
                emit(index, generation)


BEAM = BeamSearch()


def _search_batch(job: Job, indices: list[int], engine: RunEngine) -> list[Generation]:
    """Beam search over one batch of prompts; the batch is freed on return, before the next one is allocated (batch
    sizing plans memory for one batch at a time)."""
    batch, logits = job.batch(indices, engine)
    return _search(batch, logits, job)


def _search(batch: KVBatch | SharedPromptBatch, logits: torch.Tensor, job: Job) -> list[Generation]:
    """Beam search over `batch`, which holds each item's rows `num_beams` times, copies adjacent; `logits` are the
    items' [items, vocab]; a generation per item.

    Per step, the best `2 * num_beams` continuations of all beams: those ending (EOS, a stop string, the length
    limit) among the first `num_beams` become finished hypotheses, scored sum log p / length ** length_penalty; the
    best `num_beams` of the others run on. An item is done when `num_beams` hypotheses are finished and, unless
    `early_stopping` is True, its best running beam can no longer beat the worst of them. A done item's hypotheses
    stay as they are; the host looks for done items every `batch.sync_every` steps (every step with stop strings,
    which it checks on the decoded text), an eager batch drops them, and the items left go to `job.looked`.
    """
    stops, max_new = job.stops, job.stops.max_new_tokens
    beams = _Beams(logits.shape[0], logits.device, job)
    sync_every = 1 if stops.strings else batch.sync_every
    log_probs = without_padding(_log_softmax(logits), stops).repeat_interleave(beams.beams, dim=0)
    for t in range(max_new):
        if t > 0:
            log_probs = _log_softmax(batch.step(beams.running[:, :, t - 1].flatten()))
            log_probs = without_padding(log_probs, stops)
        rows = beams.advance(t, log_probs)
        if (t + 1) % sync_every and t + 1 < max_new:
            batch.take(rows)
            continue
        done_list = beams.done.tolist()
        beams.collect(done_list)
        if all(done_list):
            break
        job.looked(done_list.count(False), t + 1)
        if not batch.drops_rows:
            batch.take(rows)
            continue
        batch.take(beams.keep([position for position, is_done in enumerate(done_list) if not is_done], rows))
    return [result for result in beams.results if result is not None]


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log p in float32, read from the logits as they are (the values of a float32 copy's, without writing one)."""
    return logits.log_softmax(dim=-1, dtype=torch.float32)


class _Beams:
    """A batch's beam-search state on the device: each live item's running beams and its finished hypotheses."""

    def __init__(self, items: int, device: torch.device, job: Job):
        self.tokenizer, self.stops, settings = job.tokenizer, job.stops, job.settings
        self.beams, self.max_new = settings.num_beams, job.stops.max_new_tokens
        self.length_penalty, self.early_stopping = settings.length_penalty, settings.early_stopping
        self.eos = torch.tensor(sorted(self.stops.eos_ids), device=device)
        self.kept = max(2, 1 + len(self.stops.eos_ids)) * self.beams
        self.in_top = torch.arange(self.kept, device=device) < self.beams
        self.window = max(map(len, self.stops.strings), default=0) + 2  # tokens: each spells at least one character
        self.running = torch.zeros((items, self.beams, self.max_new), dtype=torch.long, device=device)
        self.running_scores = torch.full((items, self.beams), _NEG, device=device)
        self.running_scores[:, 0] = 0.0
        self.finished = torch.zeros_like(self.running)
        self.finished_scores = torch.full((items, self.beams), -math.inf, device=device)
        self.finished_lengths = torch.zeros((items, self.beams), dtype=torch.long, device=device)
        self.done = torch.zeros(items, dtype=torch.bool, device=device)
        self.live_items = list(range(items))  # batch item -> prompt
        self.results: list[Generation | None] = [None] * items

    def advance(self, t: int, log_probs: torch.Tensor) -> torch.Tensor:
        """Step `t` from the beams' next-token log-probabilities [rows, vocab]; the batch rows the new beams continue
        (each item's parents, in order)."""
        beams, max_new, length_penalty = self.beams, self.max_new, self.length_penalty
        vocab = log_probs.shape[-1]
        scores = (log_probs.view(len(self.live_items), beams, vocab) + self.running_scores[:, :, None]).flatten(1)
        candidate_scores, flat = scores.topk(self.kept, dim=1)
        origins, new_tokens = flat // vocab, flat % vocab
        candidates = self.running.gather(1, origins[:, :, None].expand(-1, -1, max_new))
        candidates[:, :, t] = new_tokens
        hits = torch.isin(new_tokens, self.eos)
        if self.stops.strings:
            tails = candidates[:, :, max(0, t + 1 - self.window) : t + 1]
            hits |= _stop_hits(self.tokenizer, tails, self.stops.strings)
        if t + 1 == max_new:
            hits[:] = True

        ending = hits & self.in_top
        ending_scores = torch.where(ending, candidate_scores / (t + 1) ** length_penalty, -math.inf)
        merged_scores, best = torch.cat([self.finished_scores, ending_scores], dim=1).topk(beams, dim=1)
        merged = torch.cat([self.finished, candidates], dim=1).gather(1, best[:, :, None].expand(-1, -1, max_new))
        lengths = torch.cat([self.finished_lengths, torch.full_like(ending_scores, t + 1, dtype=torch.long)], 1)
        done = self.done
        self.finished = torch.where(done[:, None, None], self.finished, merged)
        self.finished_lengths = torch.where(done[:, None], self.finished_lengths, lengths.gather(1, best))
        self.finished_scores = torch.where(done[:, None], self.finished_scores, merged_scores)

        self.running_scores, chosen = (candidate_scores + hits * _NEG).topk(beams, dim=1)
        self.running = candidates.gather(1, chosen[:, :, None].expand(-1, -1, max_new))
        parents = origins.gather(1, chosen)
        self.done = done | self._now_done(t)
        if t + 1 == max_new:
            self.done[:] = True
        return (torch.arange(len(self.live_items), device=parents.device)[:, None] * beams + parents).flatten()

    def _now_done(self, t: int) -> torch.Tensor:
        """Items with `num_beams` finished hypotheses that, unless `early_stopping` is True, their best running beam
        can no longer beat."""
        full = torch.isfinite(self.finished_scores).all(dim=1)
        if self.early_stopping is True:
            return full
        never = self.early_stopping == "never" and self.length_penalty > 0
        best_length = self.max_new if never else t + 1
        best_possible = self.running_scores[:, 0] / best_length**self.length_penalty
        return full & (best_possible <= self.finished_scores.min(dim=1).values)

    def collect(self, done_list: list[bool]) -> None:
        """Each done item's best hypothesis, once."""
        for position in (position for position, is_done in enumerate(done_list) if is_done):
            if self.results[self.live_items[position]] is None:
                length = int(self.finished_lengths[position, 0])
                token_ids = self.finished[position, 0, :length].tolist()
                self.results[self.live_items[position]] = _beam_generation(
                    self.tokenizer, token_ids, float(self.finished_scores[position, 0]), self.stops
                )

    def keep(self, keep: list[int], rows: torch.Tensor) -> torch.Tensor:
        """Drop every item but those at positions `keep`; the batch rows that reorder the beams and drop the done
        items in one copy."""
        keep_index = torch.tensor(keep, device=rows.device)
        self.live_items = [self.live_items[position] for position in keep]
        self.running, self.running_scores, self.done = (
            self.running[keep_index], self.running_scores[keep_index], self.done[keep_index]
        )
        self.finished, self.finished_scores, self.finished_lengths = (
            self.finished[keep_index], self.finished_scores[keep_index], self.finished_lengths[keep_index]
        )
        return rows.view(-1, self.beams)[keep_index].flatten()


def _stop_hits(tokenizer: PreTrainedTokenizerBase, tails: torch.Tensor, stops: tuple[str, ...]) -> torch.Tensor:
    """[items, candidates]: does the decoded tail [items, candidates, window] hold a stop string."""
    items, candidates, window = tails.shape
    texts = tokenizer.batch_decode(tails.reshape(-1, window).tolist(), skip_special_tokens=True)
    hits = [first_stop(text, stops) is not None for text in texts]
    return torch.tensor(hits, device=tails.device).view(items, candidates)


def _beam_generation(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], score: float, stops: Stops) -> Generation:
    if token_ids and token_ids[-1] in stops.eos_ids:
        kept = token_ids[:-1]
        return Generation(tokenizer.decode(kept, skip_special_tokens=True), kept, "eos", score=score)
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cut = first_stop(text, stops.strings)
    return Generation(text[:cut], token_ids, "length" if cut is None else "stop", score=score)
