"""One trial's cost: its training set counted, the layout its workers would choose on the card, and the time of its
parts at the table's figures (measured, or derived and said how)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from clozemath.config import EvalSetConfig, ExperimentConfig, ModelConfig, TrainConfig
from clozemath.cost.shapes import Shape, meta_shape, training_flops_per_token
from clozemath.cost.throughput import Card, Figure, Throughput
from clozemath.data.sources import load_problems, read_problem_ids
from clozemath.data.tokenize import IGNORE_INDEX
from clozemath.errors import ClozeMathError
from clozemath.eval.during_training import during_training_engine
from clozemath.train.budget import Footprint, matched_epochs
from clozemath.train.layout import Layout, choose_layout, packs, row_tokens, zero_stage
from clozemath.train.packing import packs_needed
from clozemath.train.zero import TrainingMemory, model_memory, planned_row_tokens

SAMPLE_PROBLEMS = 500
"""Training problems whose samples are built and tokenized to count a set's (the counts are scaled to the set)."""
FIGURE_NEW_TOKENS = 256
"""The new tokens a problem of the table's evaluation figures decodes."""


@dataclass(frozen=True)
class DataCount:
    """A training set's samples and tokens, from a sample of its problems scaled to all of them."""

    samples: int
    tokens: int
    lengths: list[int]
    """Of the sampled problems' samples; `scale` of them stand for the set."""
    scale: float
    target_share: float
    context: float
    """The mean number of positions a token attends to (its place in its sample, + 1)."""
    how: str


def count_data(config: ExperimentConfig, tokenizer_model: ModelConfig, tokenizer_note: str) -> DataCount:
    """The run's preprocessing steps (`clozemath.data.prepare`) on its first `SAMPLE_PROBLEMS` problems, with the
    tokenizer of `tokenizer_model`."""
    from clozemath.data.prepare import prepare_data

    data = config.data
    total = len(load_problems(data.dataset, data.split, data.path, data.limit))
    used = min(total, SAMPLE_PROBLEMS)
    prepared = prepare_data(config.model_copy(update={"model": tokenizer_model}), limit=used)
    encoded = [row for row in prepared.encoded if row is not None]
    lengths = [len(row["input_ids"]) for row in encoded]
    targets = sum(sum(label != IGNORE_INDEX for label in row["labels"]) for row in encoded)
    scale = total / max(used, 1)
    how = f"{'all' if used == total else f'{used:,} of'} {total:,} problems{', scaled' if used < total else ''}"
    return DataCount(
        samples=round(len(lengths) * scale), tokens=round(sum(lengths) * scale), lengths=lengths, scale=scale,
        target_share=targets / max(sum(lengths), 1),
        context=sum(n * (n + 1) / 2 for n in lengths) / max(sum(lengths), 1),
        how=f"{how}; tokens {tokenizer_note}",
    )


STAND_IN_TOKENIZER = "llama-3.2-1b-random"
"""The models config whose tokenizer counts tokens when neither a model's own nor its shape's is on this machine (a
model shipped in chunks, not yet installed): the Llama-3.2 tokenizer that `make install` brings."""


def local_tokenizer_model(model: ModelConfig, candidates: list[ModelConfig]) -> tuple[ModelConfig, str]:
    """The model config to count tokens with: the model's own tokenizer where it is on this machine, else the first
    of `candidates` whose tokenizer is (an estimate, said so)."""
    from clozemath.model.tokenizer import load_tokenizer

    for counting in [model, *candidates]:
        try:
            load_tokenizer(counting)
        except ClozeMathError:
            continue
        if counting is model:
            return model, f"counted with {model.name}'s tokenizer"
        return counting, f"estimated with {counting.name}'s tokenizer ({model.name}'s is not on this machine)"
    names = ", ".join(c.name for c in [model, *candidates])
    raise ClozeMathError(f"--dry-run: no tokenizer to count tokens with on this machine (tried {names})")


@dataclass(frozen=True)
class TrialCost:
    name: str
    gpus: float
    samples: int
    tokens: int
    layout: Layout | None
    """None: a method that trains nothing."""
    stage: int | None
    train_s: float
    first_step_s: float
    eval_s: float
    fixed_s: float
    """Workers' start, model loads, preprocessing."""

    @property
    def wall_s(self) -> float:
        return self.fixed_s + self.first_step_s + self.train_s + self.eval_s


@dataclass
class Estimator:
    """Estimates trials on `card` for a cluster of `nodes` x `gpus_per_node` GPUs; keeps what trials share (shapes,
    counts, figures used) so that a grid counts each once."""

    table: Throughput
    card: Card
    gpus_per_node: float
    notes: dict[str, str] = field(default_factory=dict)
    """Each figure used, by what it is, with its source or derivation."""
    _shapes: dict[str, tuple[Shape, ModelConfig]] = field(default_factory=dict)
    _counts: dict[str, DataCount] = field(default_factory=dict)
    _prepared: set[str] = field(default_factory=set)
    _compiled: set[tuple[Any, ...]] = field(default_factory=set)
    _problems: dict[str, int] = field(default_factory=dict)
    _figures: dict[tuple[Any, ...], Figure] = field(default_factory=dict)
    stand_ins: set[str] = field(default_factory=set)
    """The models whose tokens are counted with another model's tokenizer (theirs is not on this machine)."""

    # -- shapes and counts

    def shape(self, model: ModelConfig) -> tuple[Shape, ModelConfig]:
        """The model's shape and the model config its tokens are counted with (once per model)."""
        key = model.model_dump_json()
        if key not in self._shapes:
            from clozemath.model.tokenizer import load_tokenizer

            shape_cfg = self.table.shape_of(model)
            counting, note = local_tokenizer_model(model, [shape_cfg, self.table.model_config(STAND_IN_TOKENIZER)])
            declared = (shape_cfg.random_init or {}).get("vocab_size")  # the shape's own, where a stand-in counts
            built = meta_shape(shape_cfg, declared if declared and counting is not model else
                               len(load_tokenizer(counting)))
            params = sum({id(p): p.numel() for p in built.parameters()}.values())
            self._shapes[key] = (Shape(built, params, note), counting)
            if counting is not model:
                self.stand_ins.add(model.name)
        return self._shapes[key]

    def count(self, config: ExperimentConfig, counting: ModelConfig, note: str) -> DataCount:
        """Counted once per training set, method and tokenizer (the first seed's counts stand for the others')."""
        key = "|".join([config.data.model_copy(update={"seed": None}).model_dump_json(),
                        config.method.model_dump_json(), counting.model_dump_json()])
        if key not in self._counts:
            self._counts[key] = count_data(config, counting, note)
        return self._counts[key]

    def counted(self) -> list[str]:
        """How each training set was counted, once each."""
        return sorted({count.how for count in self._counts.values()})

    def measured_shape(self, name: str) -> Shape | None:
        """The shape of a model the table has figures for (None where it cannot be built here)."""
        try:
            return self.shape(self.table.model_config(name))[0]
        except ClozeMathError:
            return None

    # -- figures

    def _note(self, what: str, figure: Figure) -> Figure:
        self.notes.setdefault(what, f"{figure.value:,.1f} ({figure.how})")
        return figure

    def train_rate(self, model: ModelConfig, shape: Shape, data: DataCount, compiled: bool) -> Figure:
        """Real tokens/s of one GPU for this model, compiled or not: measured on this card; else measured on another
        card, by the ratio of their peaks; else of the model nearest in FLOPs a token on this card, by that ratio."""
        key = ("train", self.table.figures_name(model), compiled, id(data))
        if key not in self._figures:
            self._figures[key] = self._train_rate(model, shape, data, compiled)
        return self._figures[key]

    def _train_rate(self, model: ModelConfig, shape: Shape, data: DataCount, compiled: bool) -> Figure:
        kind = "compiled" if compiled else "eager"
        name = self.table.figures_name(model)
        what = f"training {name} {kind} on {self.card.name}, tokens/s"
        entry = self.table.measured(name, "train", self.card.name)
        if entry and kind in entry:
            return self._note(what, Figure(entry[kind], f"measured: {entry.get('source', 'the table')}"))
        for card, entry in self.table.models.get(name, {}).get("train", {}).items():
            if kind in entry and card in self.table.cards:
                ratio = self.card.peak_flops / self.table.cards[card].peak_flops
                return self._note(what, Figure(entry[kind] * ratio, f"{card}'s {entry[kind]:,.0f} x the peaks' ratio "
                                                                     f"{ratio:.2f}; {entry.get('source', '')}"))
        mine = training_flops_per_token(shape.model, data.target_share, data.context)
        best: tuple[float, str, float] | None = None
        for other, entries in self.table.models.items():
            entry = entries.get("train", {}).get(self.card.name, {})
            if other == name or kind not in entry:
                continue
            other_shape = self.measured_shape(other)
            if other_shape is None:
                continue
            theirs = training_flops_per_token(other_shape.model, data.target_share, data.context)
            if best is None or abs(math.log(theirs / mine)) < abs(math.log(best[0] / mine)):
                best = (theirs, other, entry[kind])
        if best is None:
            raise ClozeMathError(f"{self.table.path}: no {kind} training figure on {self.card.name} to estimate {name} "
                                 "from: add one")
        theirs, other, value = best
        return self._note(what, Figure(value * theirs / mine, f"{other}'s {value:,.0f} x its FLOPs a token over "
                                                              f"{name}'s ({theirs / 1e9:.2f} / {mine / 1e9:.2f} GFLOP)"))

    def eval_rate(self, model: ModelConfig, shape: Shape, decoding: str, engine: str) -> Figure:
        """Problems/s of one GPU at `FIGURE_NEW_TOKENS`: measured on this card; else the measured entry nearest in
        parameters (decoding reads every weight each step), by the ratio of their parameters."""
        key = ("eval", self.table.figures_name(model), decoding, engine)
        if key not in self._figures:
            self._figures[key] = self._eval_rate(model, shape, decoding, engine)
        return self._figures[key]

    def _eval_rate(self, model: ModelConfig, shape: Shape, decoding: str, engine: str) -> Figure:
        name = self.table.figures_name(model)
        what = f"evaluating {name} {decoding} ({engine}) on {self.card.name}, problems/s"
        entry = self.table.measured(name, "eval", self.card.name)
        if entry and decoding in entry.get(engine, {}):
            return self._note(what, Figure(entry[engine][decoding], f"measured: {entry.get('source', 'the table')}"))
        best: tuple[float, str, str, float] | None = None
        for other, entries in self.table.models.items():
            for card, entry in entries.get("eval", {}).items():
                if decoding not in entry.get(engine, {}):
                    continue
                other_shape = self.measured_shape(other)
                if other_shape is None:
                    continue
                params = other_shape.params
                if best is None or abs(math.log(params / shape.params)) < abs(math.log(best[0] / shape.params)):
                    best = (params, other, card, entry[engine][decoding])
        if best is None:
            raise ClozeMathError(f"{self.table.path}: no evaluation figure for {decoding} ({engine}) to estimate from")
        params, other, card, value = best
        if other == name:
            return self._note(what, Figure(value, f"measured on {card} (none on {self.card.name})"))
        return self._note(what, Figure(value * params / shape.params,
                                       f"{other} on {card}: {value:,.1f} x its parameters over {name}'s"))

    def shared_rate(self, model: ModelConfig, alone: Figure, gpus: float, what: str) -> float:
        """The rate of a trial holding `gpus` GPUs, from one GPU's `alone`. Below one GPU, the trials of a card are
        processes that take turns on it (no MPS): each gets `gpus` of the card's time, so `alone x gpus`, unless the
        table measured what each of that many trials got side by side (`shared`: a small model's eager steps leave
        the card idle between kernels, which the others fill). Where it measured another number of trials a card, the
        card's total then is shared out among these: what the card did side by side is a better guide than one trial
        alone, which for a model without figures of its own is scaled from another model's."""
        if gpus >= 1:
            return alone.value * gpus
        name = self.table.figures_name(model)
        trials = round(1 / gpus)
        entry = self.table.measured(name, "shared", self.card.name) or {}
        counts = entry.get(what, {})
        note = f"{what.replace('_', ' ')} of {name} on {self.card.name}, a trial of {trials} on a card"
        source = entry.get("source", "the table")
        if trials in counts:
            return self._note(note, Figure(counts[trials], f"measured side by side: {source}")).value
        if counts:
            nearest = min(counts, key=lambda count: (abs(count - trials), count))
            card = nearest * counts[nearest]
            return self._note(note, Figure(card / trials, f"the card's {card:,.1f} with {nearest} side by side "
                                                          f"({source}), shared by {trials}")).value
        return self._note(note, Figure(alone.value * gpus, f"the card's {alone.value:,.1f} x {gpus:g}: taking turns "
                                                           "(not measured side by side)")).value

    def first_step(self, model: ModelConfig, warm: bool) -> Figure:
        name = self.table.figures_name(model)
        which = "warm" if warm else "cold"
        what = f"first compiled step of {name}, {which} cache"
        entries = self.table.models.get(name, {}).get("first_step_s", {})
        entry = entries.get(self.card.name) or next(iter(entries.values()), None)
        if entry is None:
            entry = next(e for m in self.table.models.values() for e in m.get("first_step_s", {}).values())
            how = "another model's (no figure for this one)"
        else:
            how = entry.get("source", "the table")
        value = entry.get(which, entry.get("cold"))
        return self._note(what, Figure(value, how if which in entry else f"the cold figure (no warm one): {how}"))

    def overhead_s(self, name: str, params: int = 0, samples: int = 0) -> float:
        """A fixed cost of the table's `overheads`: in seconds and/or per billion parameters, or in core-seconds per
        billion (spread over a worker's cores), or per thousand samples."""
        entry = self.table.overhead(name)
        if "core_seconds_per_billion" in entry:
            return entry["core_seconds_per_billion"] * params / 1e9 / entry.get("cores_per_gpu", 1)
        if "per_thousand_samples" in entry:
            return entry["per_thousand_samples"] * samples / 1000
        return float(entry.get("seconds", 0.0)) + entry.get("per_billion", 0.0) * params / 1e9

    def gguf_parse_s(self, models: list[ModelConfig]) -> float:
        """The grid's GGUF models, each parsed once before any trial of it trains (the first load fills the cache
        of `clozemath.model.gguf_cache` while the trials that started with it wait on its lock)."""
        distinct = {model.name: model for model in models if model.gguf_file is not None}
        return sum(self.overhead_s("gguf_parse", self.shape(model)[0].params) for model in distinct.values())

    # -- a trial

    def trial(self, config: ExperimentConfig, root: Path) -> TrialCost:
        """One trial: its training set, the layout its workers would choose on this card, and its times."""
        train = config.train
        gpus = train.num_workers * train.gpu_share
        shape, counting = self.shape(config.model)
        load_s = self.overhead_s("random_init" if config.model.random_init is not None else "load_weights",
                                 shape.params)
        if not config.method.trains:
            eval_s = self.evaluation_s(config, shape, gpus, None)
            return TrialCost(config.name, gpus, 0, 0, None, None, 0.0, 0.0, eval_s, self.eval_start_s(config, load_s))
        data = self.count(config, counting, shape.tokenizer_note)
        train = train.model_copy(update={"epochs": self.epochs(config, counting, shape, data, root)})
        stage, layout = self.shaped(config.model_copy(update={"train": train}), shape, data)
        train = train.model_copy(update={"zero_stage": stage})
        rate = self.train_rate(config.model, shape, data, layout.compiled)
        scaling = self._note(f"tokens/s a GPU with {train.num_workers} worker(s) under ZeRO-{stage}, against one",
                             self.table.scaling_factor(stage, train.num_workers, layout.compiled))
        trained = layout.steps.total_steps * train.grad_accum / layout.steps.micro_batches_per_epoch * data.tokens
        kind = "train_compiled" if layout.compiled else "train_eager"
        worker_rate = self.shared_rate(config.model, rate, train.gpu_share, kind)
        train_s = trained / (worker_rate * train.num_workers * scaling.value)
        compile_key = (self.table.figures_name(config.model), layout.row_tokens, stage) if layout.compiled else None
        first = self.first_step(config.model, warm=compile_key in self._compiled).value if compile_key \
            else self.overhead_s("first_step_uncompiled")
        if compile_key:
            self._compiled.add(compile_key)
        prepare_key = config.data.model_dump_json() + config.method.model_dump_json()
        prepare_s = 0.0 if prepare_key in self._prepared else self.overhead_s("prepare", samples=data.samples)
        self._prepared.add(prepare_key)
        eval_s = self.evaluation_s(config, shape, gpus, (layout, stage))
        evaluated = config.model_copy(update={"train": train})
        fixed = self.overhead_s("workers_start") + prepare_s + load_s + self.eval_start_s(evaluated, load_s)
        return TrialCost(config.name, gpus, data.samples, data.tokens, layout, stage, train_s, first, eval_s, fixed)

    def epochs(self, config: ExperimentConfig, counting: ModelConfig, shape: Shape, data: DataCount,
               root: Path) -> float:
        """`train.epochs`, or the epochs a matched budget gives (`train.budget`, as `ray_jobs.run.with_budget`)."""
        train = config.train
        if train.budget == "epochs":
            return train.epochs
        from clozemath.plan import budget_reference

        theirs = self.count(budget_reference(config, root), counting, shape.tokenizer_note)
        return matched_epochs(train, Footprint(theirs.samples, theirs.tokens), Footprint(data.samples, data.tokens),
                              packs(train, gpu=True))

    def shaped(self, config: ExperimentConfig, shape: Shape, data: DataCount) -> tuple[int, Layout]:
        """The ZeRO stage and the layout the workers would choose on this card (`clozemath.train.layout`'s
        `zero_stage` and `choose_layout`), from what the model would hold there (`model_memory` of its shape)."""
        train = config.train
        card = int(self.card.memory_bytes * train.gpu_share)
        memory = model_memory(shape.model, planned_row_tokens(train, config.data.max_length))
        stage = zero_stage(train, memory, card, train.num_workers)
        return stage, self.layout(train.model_copy(update={"zero_stage": stage}), shape, memory, data)

    def layout(self, train: TrainConfig, shape: Shape, memory: TrainingMemory, data: DataCount) -> Layout:
        """The workers' choice (`choose_layout`) on this card: a row sized to its memory beside the model
        (`row_tokens`), compiled or not, and the steps; each worker's share of the samples as
        `ray_jobs.train.rows_of_rank` deals them."""
        workers = train.num_workers
        shards = [data.lengths[rank::workers] for rank in range(workers)]
        longest = max(data.lengths, default=1)

        def per_epoch(row: int | None) -> int:
            if row is None:
                return int(min(map(len, shards)) * data.scale) // train.micro_batch_size
            return math.ceil(max(packs_needed(shard, row) for shard in shards) * data.scale)

        beside = self.card.memory_bytes * train.gpu_share - memory.loaded_bytes
        return choose_layout(train, row_tokens(train, shape.config, int(beside), longest), longest,
                             torch.device("cuda"), per_epoch)

    def eval_start_s(self, config: ExperimentConfig, load_s: float) -> float:
        """From a trial's request to evaluate to its first decoding step: the training worker's model made the
        evaluated one (`eval.in_worker`: the adapter merged in place), or an evaluation actor's start and model load.
        `config`: with the ZeRO stage the trial resolved."""
        from clozemath.eval.folder import evaluates_in_worker

        if not config.eval.sets:
            return 0.0
        if evaluates_in_worker(config):
            return self.overhead_s("eval_in_worker_start")
        return self.overhead_s("eval_actor_start") + load_s

    def evaluation_s(self, config: ExperimentConfig, shape: Shape, gpus: float,
                     trained: tuple[Layout, int] | None) -> float:
        """Every set with each of its decodings after training, and the evaluations during training, on the trial's
        GPUs: the graph engine after training, the engine the workers choose for a model in training during it
        (`during_training_engine`: graphs under ZeRO-2, eager under ZeRO-3)."""
        from clozemath.eval.evaluate import prompting

        length = config.eval.new_tokens(prompting(config).few_shot) / FIGURE_NEW_TOKENS
        seconds = 0.0
        for set_cfg in config.eval.sets:
            key = set_cfg.model_dump_json()
            if key not in self._problems:  # a grid names the same sets in many trials: read once
                self._problems[key] = problems_evaluated(set_cfg)
            problems = self._problems[key]
            for decoding in config.eval.decodings_of(set_cfg):
                rate = self.shared_rate(config.model, self.eval_rate(config.model, shape, decoding, "graphs"),
                                        gpus, shared_eval_key(decoding, "graphs"))
                seconds += problems * length / rate
        evaluated = config.eval.during_training()
        if trained is not None and evaluated is not None:
            layout, stage = trained
            points, problems = curve_evaluations(config, layout.steps.total_steps)
            decoding, engine = evaluated[1], during_training_engine(stage, "cuda")
            alone = self.eval_rate(config.model, shape, decoding, engine)
            ranks = 1 if stage == 3 else config.train.num_workers  # ZeRO-3's ranks decode every problem in step
            rate = self.shared_rate(config.model, alone, config.train.gpu_share,
                                    shared_eval_key(decoding, engine)) * ranks
            seconds += points * problems * length / rate
        return seconds


def shared_eval_key(decoding: str, engine: str) -> str:
    """The key of the throughput table's side-by-side evaluation figures (`shared`) for a decoding on an engine:
    `eval_<decoding>` on graphs, `eval_<decoding>_<engine>` on another."""
    return f"eval_{decoding}" if engine == "graphs" else f"eval_{decoding}_{engine}"


def problems_evaluated(set_cfg: EvalSetConfig) -> int:
    """The problems an evaluation set decodes, taken as `clozemath.eval.evaluate.eval_problems` takes them: those its
    `ids` file lists (each one checked to be in the set before work), then `limit` of them. Without ids, a set with
    a limit is taken to hold that many (counting GSM-Symbolic's means generating them: a minute)."""
    from clozemath.eval.evaluate import eval_problems

    if set_cfg.ids is not None:
        listed = len(read_problem_ids(set_cfg.ids))
        return listed if set_cfg.limit is None else min(set_cfg.limit, listed)
    return set_cfg.limit or len(eval_problems(set_cfg))


def curve_evaluations(config: ExperimentConfig, total_steps: int) -> tuple[int, int]:
    """The evaluations during training of a run of `total_steps` (`EvalConfig.during_training_steps`, as the workers
    evaluate) and the problems each decodes (`problems_evaluated` of the subset)."""
    evaluated = config.eval.during_training()
    if evaluated is None:
        return 0, 0
    subset, _ = evaluated
    return len(config.eval.during_training_steps(total_steps)), problems_evaluated(subset)
