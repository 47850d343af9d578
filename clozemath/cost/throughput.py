"""`configs/throughput.yaml`, the measured speeds an estimate starts from: cards, each model's figures with their
sources, scaling over workers, fixed costs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clozemath.config import ModelConfig
from clozemath.errors import ClozeMathError
from clozemath.safe_yaml import read_yaml

THROUGHPUT_FILE = "throughput.yaml"
"""The committed table of measured speeds, in the `configs/` folder."""


GIB = 2**30


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

    def scaling_factor(self, stage: int, workers: int, compiled: bool) -> Figure:
        """Tokens/s per GPU with `workers` workers against one, under this ZeRO stage; `compiled`: the stage's
        compiled figures where the table has them apart (`zero3_compiled`: compiling gains less under ZeRO-3)."""
        if workers == 1:
            return Figure(1.0, "one worker")
        table = (compiled and self.scaling.get(f"zero{stage}_compiled")) or self.scaling.get(f"zero{stage}", {})
        listed = sorted(int(n) for n in table if str(n).isdigit() and int(n) <= workers)
        if not listed:
            return Figure(1.0, f"ZeRO-{stage} on {workers} GPUs: not measured, assumed linear")
        return Figure(float(table[listed[-1]]), f"ZeRO-{stage}: {table.get('source', 'the table')}")
