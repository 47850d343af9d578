"""What a run or a grid will cost, before anything starts (`clozemath run CONFIG --dry-run`).

For every trial: its samples and tokens (the run's own preprocessing steps on the first `SAMPLE_PROBLEMS` problems,
scaled to the set), the steps its layout makes (the ZeRO stage, row size and compilation the workers would choose on
the card: `clozemath.train.zero`, `clozemath.train.layout.choose_layout`), and the time of its parts: training at the
measured tokens/s of its model on the card, evaluation at the measured problems/s, and the fixed costs (workers'
start, model load, the first step's compilation, preprocessing). The grid's wall time is its trials laid on the GPUs
in order, each starting when enough are free, as Tune runs them. The figures come from `configs/throughput.yaml`,
each with its source; where one is missing it is derived and the estimate says how.

Nothing here starts Ray or loads weights: the shapes are built on PyTorch's meta device, and a tokenizer is used only
where it is on this machine (else the shape's own, Llama 3's, and the counts say "estimated"); the caller keeps
transformers off the network (`HF_HUB_OFFLINE`, as the CLI sets it).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from clozemath.config import ExperimentConfig, ModelConfig, RunPlan, TrainConfig, read_yaml
from clozemath.data.sources import load_problems
from clozemath.data.tokenize import IGNORE_INDEX, MASK, SEP, SpecialTokens, sentinel
from clozemath.errors import ClozeMathError
from clozemath.train.budget import Footprint, matched_epochs
from clozemath.train.layout import Layout, choose_layout
from clozemath.train.packing import auto_pack_tokens, packs_needed
from clozemath.train.zero import TrainingMemory, auto_zero_stage, model_memory, planned_row_tokens

THROUGHPUT_FILE = "throughput.yaml"
"""The committed table of measured speeds, in the `configs/` folder."""
SAMPLE_PROBLEMS = 500
"""Training problems whose samples are built and tokenized to count a set's (the counts are scaled to the set)."""
FIGURE_NEW_TOKENS = 256
"""The new tokens a problem of the table's evaluation figures decodes."""
GIB = 2**30


# --------------------------------------------------------------------------------------------------------------
# The throughput table


@dataclass(frozen=True)
class Figure:
    value: float
    how: str
    """Where it comes from: the table's source, or how it was derived from another figure."""


@dataclass(frozen=True)
class Card:
    name: str
    memory_bytes: int
    peak_flops: float


class Throughput:
    """`configs/throughput.yaml`: cards, each model's measured speeds, scaling and fixed costs."""

    def __init__(self, root: Path) -> None:
        path = root / THROUGHPUT_FILE
        raw = read_yaml(path)
        self.root = root
        self.path = path
        self.cards = {
            name: Card(name, int(card["memory_gib"] * GIB), card["peak_tflops"] * 1e12)
            for name, card in raw.get("cards", {}).items()
        }
        self.models: dict[str, dict[str, Any]] = raw.get("models", {})
        self.scaling: dict[str, dict[Any, Any]] = raw.get("scaling", {})
        self.overheads: dict[str, dict[str, Any]] = raw.get("overheads", {})

    def card(self, name: str) -> Card:
        for key, card in self.cards.items():
            if key.lower() in name.lower():
                return card
        raise ClozeMathError(f"{self.path}: no card '{name}' (known: {', '.join(self.cards)}): add it, or pass --card")

    def shape_of(self, model: ModelConfig) -> ModelConfig:
        """A model config whose `random_init` gives the model's shape: its own; the models config its entry names
        (`shape: llama-3.1-8b-random`); or the model with the entry's inline shape (`shape: {hidden_size: ...}`)."""
        if model.random_init is not None:
            return model
        shape = self.models.get(model.name, {}).get("shape")
        if isinstance(shape, dict):
            return model.model_copy(update={"random_init": shape})
        if shape is None:
            raise ClozeMathError(f"{self.path}: model '{model.name}' has no `shape` (the name of a configs/models "
                                 "file with random_init of its shape, or the shape itself): its weights are not read "
                                 "for an estimate")
        return self.model_config(shape)

    def model_config(self, name: str) -> ModelConfig:
        return ModelConfig.model_validate(read_yaml(self.root / "models" / f"{name}.yaml"))

    def figures_name(self, model: ModelConfig) -> str:
        """The table entry holding a model's figures: a hub model's are those of the shape it names."""
        shape = self.models.get(model.name, {}).get("shape")
        return shape if isinstance(shape, str) else model.name

    def measured(self, name: str, group: str, card: str) -> dict[str, Any] | None:
        return self.models.get(name, {}).get(group, {}).get(card)

    def overhead(self, name: str) -> dict[str, Any]:
        if name not in self.overheads:
            raise ClozeMathError(f"{self.path}: no overheads.{name}")
        return self.overheads[name]

    def scaling_factor(self, stage: int, workers: int) -> Figure:
        """Tokens/s per GPU with `workers` workers against one, under this ZeRO stage."""
        if workers == 1:
            return Figure(1.0, "one worker")
        table = self.scaling.get(f"zero{stage}", {})
        listed = sorted(int(n) for n in table if str(n).isdigit() and int(n) <= workers)
        if not listed:
            return Figure(1.0, f"ZeRO-{stage} on {workers} GPUs: not measured, assumed linear")
        return Figure(float(table[listed[-1]]), f"ZeRO-{stage}: {table.get('source', 'the table')}")


# --------------------------------------------------------------------------------------------------------------
# Shapes on the meta device


@dataclass(frozen=True)
class Shape:
    """A model's shape as training builds it (LoRA, special-token rows), with nothing allocated."""

    model: torch.nn.Module
    """peft-wrapped, on the meta device."""
    params: int
    tokenizer_note: str

    @property
    def config(self) -> Any:
        return self.model.config


def special_tokens_for(vocab: int, sentinels: int) -> SpecialTokens:
    """Stand-in special tokens in the last rows of a vocabulary (only their count matters for a shape)."""
    names = [SEP, MASK, *(sentinel(k) for k in range(sentinels))]
    ids = {name: vocab - len(names) + k for k, name in enumerate(names)}
    return SpecialTokens(tokens={name: name for name in names}, ids=ids, added=True, ordinary_ids=())


def meta_shape(model: ModelConfig, vocab: int, sentinels: int = 16) -> torch.nn.Module:
    """The LoRA model a worker trains, with `model.random_init`'s shape and `vocab` rows, on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from clozemath.model.load import aligned_vocabulary, apply_lora

    settings = {key: value for key, value in (model.random_init or {}).items() if key != "seed"}
    config = LlamaConfig(vocab_size=aligned_vocabulary(vocab), **settings)
    with torch.device("meta"):
        base = LlamaForCausalLM(config).to(torch.bfloat16)
        return apply_lora(base, model.lora, special_tokens_for(vocab, sentinels))


def training_flops_per_token(model: torch.nn.Module, target_share: float, context: float) -> float:
    """FLOPs of one trained token, the convention of issue 24: every frozen matrix product 4x its weights (forward and
    the input's gradient), LoRA's own 6x (its weights' gradients too), the output layer at the target positions only
    (`target_share` of the tokens; 6x, or 4x when no token row trains and it needs no weight gradient), and attention
    12 x layers x (heads x head dim) x `context`, the mean number of positions a token attends to.

    The per-token form of `bench/limits.py`'s count (the benchmarks' MFU, exact per sample), for scaling a figure
    between models; `bench/` is no package of the library, so the two live apart: change them together."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    frozen = sum(p.numel() for name, p in base.named_parameters()
                 if ".layers." in name and p.dim() == 2 and not p.requires_grad)
    lora = sum(p.numel() for name, p in base.named_parameters() if "lora_" in name)
    rows_train = any("trainable_tokens" in name for name, _ in base.named_parameters())
    output = (6 if rows_train else 4) * config.vocab_size * config.hidden_size * target_share
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * context
    return 4 * frozen + 6 * lora + output + attention


# --------------------------------------------------------------------------------------------------------------
# A trial's data


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


def local_tokenizer_model(model: ModelConfig, shape: ModelConfig) -> tuple[ModelConfig, str]:
    """The model config to count tokens with: the model's own tokenizer where it is on this machine, else its
    shape's (an estimate, said so)."""
    from clozemath.model.load import load_tokenizer

    try:
        load_tokenizer(model)
        return model, f"counted with {model.name}'s tokenizer"
    except ClozeMathError:
        return shape, f"estimated with {shape.name}'s tokenizer ({model.name}'s is not on this machine)"


# --------------------------------------------------------------------------------------------------------------
# A trial's cost


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

    # -- shapes and counts

    def shape(self, model: ModelConfig) -> tuple[Shape, ModelConfig]:
        """The model's shape and the model config its tokens are counted with (once per model)."""
        key = model.model_dump_json()
        if key not in self._shapes:
            from clozemath.model.load import load_tokenizer

            shape_cfg = self.table.shape_of(model)
            counting, note = local_tokenizer_model(model, shape_cfg)
            built = meta_shape(shape_cfg, len(load_tokenizer(counting)))
            params = sum({id(p): p.numel() for p in built.parameters()}.values())
            self._shapes[key] = (Shape(built, params, note), counting)
        return self._shapes[key]

    def count(self, config: ExperimentConfig, counting: ModelConfig, note: str) -> DataCount:
        """Counted once per training set, method and tokenizer (the first seed's counts stand for the others')."""
        key = "|".join([config.data.model_copy(update={"seed": None}).model_dump_json(),
                        config.method.model_dump_json(), counting.model_dump_json()])
        if key not in self._counts:
            self._counts[key] = count_data(config, counting, note)
        return self._counts[key]

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
        """A fixed cost of the table's `overheads`: in seconds, or per billion parameters (`core_seconds` spread
        over a worker's cores), or per thousand samples."""
        entry = self.table.overhead(name)
        if "seconds" in entry:
            return float(entry["seconds"])
        if "core_seconds_per_billion" in entry:
            return entry["core_seconds_per_billion"] * params / 1e9 / entry.get("cores_per_gpu", 1)
        if "per_thousand_samples" in entry:
            return entry["per_thousand_samples"] * samples / 1000
        return entry["per_billion"] * params / 1e9

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
            return TrialCost(config.name, gpus, 0, 0, None, None, 0.0, 0.0, eval_s, load_s)
        data = self.count(config, counting, shape.tokenizer_note)
        memory = model_memory(shape.model, planned_row_tokens(train, config.data.max_length))
        stage = auto_zero_stage(memory, self.card.memory_bytes * train.gpu_share, train.num_workers) \
            if train.zero_stage == "auto" else train.zero_stage
        train = train.model_copy(update={"zero_stage": stage, "epochs": self.epochs(config, counting, shape, data,
                                                                                      root)})
        layout = self.layout(train, shape, memory, data)
        rate = self.train_rate(config.model, shape, data, layout.compiled)
        scaling = self._note(f"tokens/s a GPU with {train.num_workers} worker(s) under ZeRO-{stage}, against one",
                             self.table.scaling_factor(stage, train.num_workers))
        trained = layout.plan.total_steps * train.grad_accum / layout.plan.micro_batches_per_epoch * data.tokens
        train_s = trained / (rate.value * train.num_workers * train.gpu_share * scaling.value)
        compile_key = (self.table.figures_name(config.model), layout.row_tokens, stage) if layout.compiled else None
        first = self.first_step(config.model, warm=compile_key in self._compiled).value if compile_key \
            else self.overhead_s("first_step_uncompiled")
        if compile_key:
            self._compiled.add(compile_key)
        prepare_key = config.data.model_dump_json() + config.method.model_dump_json()
        prepare_s = 0.0 if prepare_key in self._prepared else self.overhead_s("prepare", samples=data.samples)
        self._prepared.add(prepare_key)
        eval_s = self.evaluation_s(config, shape, gpus, (layout, stage))
        fixed = self.overhead_s("workers_start") + prepare_s + (2 if config.eval.sets else 1) * load_s
        return TrialCost(config.name, gpus, data.samples, data.tokens, layout, stage, train_s, first, eval_s, fixed)

    def epochs(self, config: ExperimentConfig, counting: ModelConfig, shape: Shape, data: DataCount,
               root: Path) -> float:
        """`train.epochs`, or the epochs a matched budget gives (`train.budget`, as `ray_jobs.run.with_budget`)."""
        train = config.train
        if train.budget == "epochs":
            return train.epochs
        from clozemath.config import load_method

        reference = config.model_copy(update={"method": load_method(train.budget_reference, root)}, deep=True)
        theirs = self.count(reference, counting, shape.tokenizer_note)
        packed = train.pack_tokens is not None
        return matched_epochs(train, Footprint(theirs.samples, theirs.tokens), Footprint(data.samples, data.tokens),
                              packed)

    def layout(self, train: TrainConfig, shape: Shape, memory: TrainingMemory, data: DataCount) -> Layout:
        """The workers' choice (`choose_layout`) on this card: a row sized to its memory beside the model, compiled
        or not, and the steps; each worker's share of the samples as `ray_jobs.train.rows_of_rank` deals them."""
        workers = train.num_workers
        shards = [data.lengths[rank::workers] for rank in range(workers)]
        longest = max(data.lengths, default=1)

        def per_epoch(budget: int | None) -> int:
            if budget is None:
                return int(min(map(len, shards)) * data.scale) // train.micro_batch_size
            return math.ceil(max(packs_needed(shard, budget) for shard in shards) * data.scale)

        budget: int | None = train.pack_tokens if isinstance(train.pack_tokens, int) else None
        if train.pack_tokens == "auto":
            beside = self.card.memory_bytes * train.gpu_share - memory.frozen_bytes - 4 * memory.trained_params
            budget = auto_pack_tokens(shape.config, int(beside), longest)
        return choose_layout(train, budget, longest, torch.device("cuda"), per_epoch)

    def evaluation_s(self, config: ExperimentConfig, shape: Shape, gpus: float,
                     trained: tuple[Layout, int] | None) -> float:
        """Every set with each of its decodings after training, and the evaluations during training, on the trial's
        GPUs (the graph engine after training; a model in training decodes without graphs)."""
        from clozemath.eval.evaluate import eval_problems

        length = config.eval.max_new_tokens / FIGURE_NEW_TOKENS
        seconds = 0.0
        for set_cfg in config.eval.sets:
            key = set_cfg.model_dump_json()
            if key not in self._problems:  # a grid names the same sets in many trials: read once
                # a set with a limit is taken to hold that many (generating GSM-Symbolic's takes a minute)
                self._problems[key] = set_cfg.limit or len(eval_problems(set_cfg))
            problems = self._problems[key]
            for decoding in config.eval.decodings_of(set_cfg):
                rate = self.eval_rate(config.model, shape, decoding, "graphs").value * max(gpus, 1.0)
                seconds += problems * length / rate
        if trained is not None and config.eval.every_steps and config.eval.sets:
            layout, stage = trained
            total = layout.plan.total_steps
            points = total // config.eval.every_steps + (1 if total % config.eval.every_steps else 0)
            first = config.eval.sets[0]
            limit = min(first.limit or config.eval.during_training_limit, config.eval.during_training_limit)
            decoding = config.eval.decodings_of(first)[0]
            share = 1 if stage == 3 else config.train.num_workers  # ZeRO-3's ranks decode every problem in step
            rate = self.eval_rate(config.model, shape, decoding, "eager").value * share
            seconds += points * limit * length / rate
        return seconds


# --------------------------------------------------------------------------------------------------------------
# A grid on a cluster


@dataclass(frozen=True)
class Scheduled:
    trial: TrialCost
    start_s: float
    nodes: tuple[int, ...]


def schedule(trials: Sequence[TrialCost], nodes: int, gpus_per_node: float,
             max_concurrent: int | None = None) -> list[Scheduled]:
    """The trials in order, each started as soon as enough GPUs are free (on one node where it fits one; across
    nodes else) and fewer than `max_concurrent` trials run, as Tune starts a grid's trials."""
    free = [gpus_per_node] * nodes
    running: list[tuple[float, int, list[tuple[int, float]]]] = []  # (end, order, [(node, gpus)])
    now, placed = 0.0, []
    for order, trial in enumerate(trials):
        if trial.gpus > nodes * gpus_per_node + 1e-9:
            raise ClozeMathError(f"{trial.name}: needs {trial.gpus:g} GPUs, the cluster has {nodes * gpus_per_node:g}")
        while True:
            where = _place(free, trial.gpus)
            if where is not None and (max_concurrent is None or len(running) < max_concurrent):
                break
            end, _, held = heapq.heappop(running)
            now = max(now, end)
            for node, gpus in held:
                free[node] += gpus
        for node, gpus in where:
            free[node] -= gpus
        heapq.heappush(running, (now + trial.wall_s, order, where))
        placed.append(Scheduled(trial, now, tuple(node for node, _ in where)))
    return placed


def _place(free: list[float], need: float) -> list[tuple[int, float]] | None:
    """GPUs for a trial: the first node that holds it whole, else the nodes' free GPUs in turn."""
    for node, gpus in enumerate(free):
        if gpus + 1e-9 >= need:
            return [(node, need)]
    if sum(free) + 1e-9 < need:
        return None
    taken, left = [], need
    for node, gpus in enumerate(free):
        if gpus > 1e-9 and left > 1e-9:
            part = min(gpus, left)
            taken.append((node, part))
            left -= part
    return taken


@dataclass(frozen=True)
class GridEstimate:
    name: str
    card: Card
    nodes: int
    gpus_per_node: float
    scheduled: list[Scheduled]
    ray_start_s: float
    notes: dict[str, str]
    counts: list[str]

    @property
    def wall_s(self) -> float:
        return self.ray_start_s + max((s.start_s + s.trial.wall_s for s in self.scheduled), default=0.0)

    @property
    def gpu_hours(self) -> float:
        return sum(s.trial.gpus * s.trial.wall_s for s in self.scheduled) / 3600


def estimate(plan: RunPlan, gpus: float, card_name: str, nodes: int = 1) -> GridEstimate:
    """The cost of `plan` on `nodes` nodes of `gpus / nodes` GPUs of `card_name` each."""
    table = Throughput(plan.root)
    card = table.card(card_name)
    estimator = Estimator(table, card, gpus / nodes)
    trials = [estimator.trial(config, plan.root) for config in plan.experiments]
    scheduled = schedule(trials, nodes, gpus / nodes, plan.grid.max_concurrent_trials)
    counts = sorted({count.how for count in estimator._counts.values()})
    return GridEstimate(plan.grid.name, card, nodes, gpus / nodes, scheduled, estimator.overhead_s("ray_start"),
                        estimator.notes, counts)


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{seconds / 60:.1f} min"


def estimate_text(result: GridEstimate) -> str:
    """The dry-run's printout: a line per trial, the totals, and the figures behind them."""
    cluster = f"{result.nodes} node{'s' if result.nodes > 1 else ''} of {result.gpus_per_node:g} x {result.card.name}"
    rows = [
        f"{result.name}: {len(result.scheduled)} trial(s) on {cluster}; an estimate, nothing was started.",
        "",
        "| trial | GPUs | samples | their tokens | steps | row | ZeRO | compiled | train | first step | eval | fixed | "
        "starts at | wall | GPU-h |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for placed in result.scheduled:
        trial, layout = placed.trial, placed.trial.layout
        steps = f"{layout.plan.total_steps:,}" if layout else "-"
        row = "-" if layout is None else (f"{layout.row_tokens:,}" if layout.row_tokens else "padded")
        compiled = "-" if layout is None else ("yes" if layout.compiled else "no")
        rows.append(
            f"| {trial.name} | {trial.gpus:g} | {trial.samples:,} | {trial.tokens / 1e6:.1f}M | {steps} | {row} | "
            f"{trial.stage or '-'} | {compiled} | {_duration(trial.train_s)} | {_duration(trial.first_step_s)} | "
            f"{_duration(trial.eval_s)} | {_duration(trial.fixed_s)} | {_duration(placed.start_s)} | "
            f"{_duration(trial.wall_s)} | {trial.gpus * trial.wall_s / 3600:.2f} |"
        )
    rows += [
        "",
        f"Total: {result.gpu_hours:,.1f} GPU-hours; wall time {_duration(result.wall_s)} on {cluster} "
        f"(Ray's start {result.ray_start_s:.0f} s, then the trials in order, each as soon as its GPUs are free).",
        *(["Training sets counted: " + "; ".join(result.counts)] if result.counts else []),
        "Figures (configs/throughput.yaml):",
        *(f"- {what}: {how}" for what, how in result.notes.items()),
        "A compiled trial's first step is cold once per model, row size and stage, warm after (the compile cache that "
        "every trial and node shares: train.compile_cache). Evaluation runs on the trial's GPUs; its figures are of "
        "random weights, whose rows never stop before max_new_tokens: an upper bound for a trained model.",
    ]
    return "\n".join(rows)

