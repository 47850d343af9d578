"""Greedy decoding, and the base of decodings whose rows all continue greedily from their first token (CoT-decoding's
branches): `RowDecoding`, on either engine.

The eager engine runs a batch until its last row ends, dropping finished rows once they are `_COMPACT_SHARE` of it.
The static engines batch continuously (`_Refilling`): when a prompt's rows have all ended, the next waiting prompt's
pass is moved into them, so that the step keeps one shape for the whole run and its rows work for live prompts; ended
rows ride along only until that look.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from clozemath.eval.decoding.eager import KVBatch
from clozemath.eval.decoding.job import Decoding, Emit, Job, RunEngine, batches
from clozemath.eval.decoding.static import StaticBatch
from clozemath.eval.decoding.tokens import Generation, Row, TextStream, greedy_choice, top2_margin

_COMPACT_SHARE = 0.25
"""Eager engine: drop finished rows once they are this share of the batch (a copy of the cache, against wasted
work)."""


class RowDecoding(Decoding):
    """A prompt's `copies` rows (adjacent) begin from its prompt pass's logits (`first`), continue greedily until each
    ends, and make the prompt's generation together (`generation`). As such: greedy decoding, one row a prompt."""

    margins = False
    """Rows keep each token's margin p(top-1) - p(top-2) (CoT-decoding's confidence)."""

    def first(self, logits: torch.Tensor, job: Job) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's first token, prompt-major [prompts * copies], and its margin where rows keep margins."""
        return greedy_choice(logits, job.stops.vocab), None

    def generation(self, rows: Sequence[Row], job: Job) -> Generation:
        """A prompt's generation from its rows."""
        return rows[0].generation()

    def rows(self, prompts: int, job: Job) -> list[Row]:
        """Fresh rows for `prompts` prompts, `copies` each."""
        stops = job.stops.strings
        return [Row(TextStream(job.backend, stops), [] if self.margins else None) for _ in range(prompts * job.copies)]

    def decode(self, job: Job, indices: list[int], size: int, engine: RunEngine, emit: Emit) -> None:
        if engine != "eager":
            _Refilling(self, job, indices, size, engine == "graphs", emit).run()
            return
        for batch_indices in batches(indices, size):
            batch, logits = job.batch(batch_indices, "eager")
            assert isinstance(batch, KVBatch)
            self._decode_eagerly(batch, logits, job, batch_indices, emit)

    def _decode_eagerly(
        self, batch: KVBatch, logits: torch.Tensor, job: Job, indices: Sequence[int], emit: Emit
    ) -> None:
        """`batch` holds the rows of prompts `indices` `copies` times each, copies adjacent; `logits` are the prompts'
        [prompts, vocab]. The host reads each step's tokens: a prompt whose rows have all ended goes to `emit` then,
        finished rows leave the batch once they are `_COMPACT_SHARE` of it, and where the rest are goes to
        `job.looked`."""
        stops = job.stops
        tokens, margins = self.first(logits, job)
        rows = self.rows(len(indices), job)
        slots = list(range(len(rows)))  # batch row -> row
        made = 0  # tokens each live row has made
        while True:
            made += 1
            token_list = tokens.tolist()
            margin_list = margins.tolist() if margins is not None else None
            ended = []  # rows that end at this step
            for slot, row_index in enumerate(slots):
                row = rows[row_index]
                if row.finish_reason is None:
                    row.extend(token_list[slot : slot + 1], margin_list and margin_list[slot : slot + 1], stops)
                    if row.finish_reason is not None:
                        ended.append(row_index)
            self._emit_ended(rows, ended, indices, emit, job)
            live = [slot for slot, row_index in enumerate(slots) if rows[row_index].finish_reason is None]
            if not live:
                break
            job.looked(len({slots[slot] // job.copies for slot in live}), made)
            if len(slots) - len(live) >= _COMPACT_SHARE * len(slots):
                index = torch.tensor(live, device=tokens.device)
                batch.take(index)
                tokens = tokens[index]
                slots = [slots[slot] for slot in live]
            logits = batch.step(tokens)
            margins = top2_margin(logits) if margins is not None else None
            tokens = greedy_choice(logits, stops.vocab)

    def _emit_ended(self, rows: list[Row], ended: list[int], indices: Sequence[int], emit: Emit, job: Job) -> None:
        """Emit the prompts (of `indices`) whose last row is among the rows `ended` just now."""
        copies = job.copies
        for prompt in dict.fromkeys(row_index // copies for row_index in ended):
            prompt_rows = rows[prompt * copies : (prompt + 1) * copies]
            if all(row.finish_reason is not None for row in prompt_rows):
                emit(indices[prompt], self.generation(prompt_rows, job))


GREEDY = RowDecoding()


class _Refilling:
    """A `RowDecoding` on the static engines, with continuous batching: the prompts `order` (longest first) through
    one `StaticBatch` of `size` prompts' rows (`copies` a prompt), its step one shape for the whole run (one CUDA
    graph).

    Every `sync_every` steps (fewer where every prompt's rows reach `max_new_tokens` sooner) the host reads the new
    tokens: each prompt whose rows have all ended goes to `emit`, the next waiting prompts take its rows, their
    prompt pass batched and moved into those rows (`StaticBatch.place`), and where the batch is goes to `job.looked`.
    A prompt's rows compute what they would in any other batch: rows never see each other, and a refilled row's mask
    hides its former occupant (only the rounding may differ, as between any two batch shapes). The text of ended
    prompts is decoded while the device runs the next steps.
    """

    def __init__(self, decoding: RowDecoding, job: Job, order: Sequence[int], size: int, graphs: bool, emit: Emit):
        self.decoding, self.job, self.graphs, self.emit = decoding, job, graphs, emit
        self.units = min(size, len(order))  # a unit: one prompt's rows
        self.waiting = deque(order)
        self.batch: StaticBatch | None = None
        self.occupant: list[int | None] = [None] * self.units
        self.rows = decoding.rows(self.units, job)  # placeholders until placed
        self.produced = [0] * self.units  # tokens the device has made for a unit's prompt (its first included)
        self.fresh: set[int] = set()  # units placed since the host's last look: the history's column 0 is theirs
        self.ended: list[tuple[int, list[Row]]] = []  # prompts whose rows have all ended, not yet emitted

    def run(self) -> None:
        job = self.job
        self._fill(list(range(self.units)))
        batch = self.batch
        assert batch is not None
        try:
            while live := [unit for unit in range(self.units) if self.occupant[unit] is not None]:
                furthest = max(self.produced[unit] for unit in live)
                steps = min(batch.sync_every, max(job.stops.max_new_tokens - self.produced[unit] for unit in live))
                assert steps or self.fresh, "a row that made max_new_tokens has ended"
                batch.advance(steps)
                job.stats.steps += steps
                job.stats.row_steps += steps * self.units * job.copies
                self._emit_ended()  # the host's text work while the device runs the steps
                job.looked(len(live), furthest)  # where the last look left the batch
                self._fill(self._look(batch, live, steps))
        finally:  # out of memory at a refill: the prompts that have ended are done
            self._emit_ended()

    def _fill(self, free: list[int]) -> None:
        """The next waiting prompts take the rows of units `free`, their prompt pass batched."""
        job, copies = self.job, self.job.copies
        taken = [self.waiting.popleft() for _ in free[: len(self.waiting)]]
        if not taken:
            return
        targets = [unit * copies + copy for unit in free[: len(taken)] for copy in range(copies)]
        sources = [prompt for prompt in range(len(taken)) for _ in range(copies)]
        lengths = [len(job.prompts[taken[prompt]]) for prompt in sources]
        passed, logits = job.prefill(taken)
        tokens, margins = self.decoding.first(logits, job)
        if self.batch is None:
            self.batch = job.static_batch(self.units, passed, self.graphs, margins is not None)
        else:
            job.stats.refills += len(taken)
        self.batch.place(targets, passed, sources, lengths, tokens, margins)
        for target, row in zip(targets, self.decoding.rows(len(taken), job)):
            self.rows[target] = row
        for unit, prompt in zip(free, taken):
            self.occupant[unit], self.produced[unit] = prompt, 1
            self.fresh.add(unit)

    def _look(self, batch: StaticBatch, live: list[int], steps: int) -> list[int]:
        """The host's look at the last `steps` steps' tokens: the units whose prompt has ended (now free)."""
        copies, stops = self.job.copies, self.job.stops
        tokens, margins = batch.read(steps)
        free = []
        for unit in live:
            first = 0 if unit in self.fresh else 1
            unit_rows = self.rows[unit * copies : (unit + 1) * copies]
            for row_index, row in enumerate(unit_rows, start=unit * copies):
                row.extend(tokens[row_index][first:], margins and margins[row_index][first:], stops)
            self.produced[unit] += steps
            if all(row.finish_reason is not None for row in unit_rows):
                prompt = self.occupant[unit]
                assert prompt is not None
                self.ended.append((prompt, unit_rows))
                self.occupant[unit] = None
                free.append(unit)
        self.fresh.clear()
        return free

    def _emit_ended(self) -> None:
        """Each ended prompt handed over once: taken off the list before it is handed (if the taker raises, the
        `finally` of `run` hands over only the prompts after it)."""
        while self.ended:
            prompt, unit_rows = self.ended.pop(0)
            self.emit(prompt, self.decoding.generation(unit_rows, self.job))
