"""ZeRO: the stage `auto` picks from a model's memory and the card's; ZeRO-3's engine gathering a layer at a time."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch

from clozemath.config import ModelConfig, TrainConfig
from clozemath.cost import meta_shape
from clozemath.safe_yaml import read_yaml
from clozemath.train.zero import (
    OPTIMIZER_BYTES_PER_TRAINED,
    TrainingMemory,
    auto_zero_stage,
    deepspeed_config,
    model_memory,
    planned_row_tokens,
    vocabulary_elements,
)

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"
VOCAB = 128_256  # Llama 3's tokenizer (a whole number of 64-row blocks: no rows added)
GIB = 2**30


@lru_cache(maxsize=2)
def shape(name: str) -> torch.nn.Module:
    """Built once a session: the 8B shape takes seconds even on the meta device."""
    return meta_shape(ModelConfig.model_validate(read_yaml(MODELS / f"{name}.yaml")), VOCAB, sentinels=14)


def by_hand(hidden: int, kv: int, mlp: int, layers: int, tied: bool, rank: int = 32) -> tuple[int, int]:
    """(frozen parameters, LoRA's parameters) of a Llama shape with 128,256 rows: q and o are hidden x hidden, k and
    v hidden x kv, the MLP's three hidden x mlp; two norms a layer and a final one; LoRA adds rank x (in + out) to
    each of the 7 projections."""
    rows = VOCAB
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp + 2 * hidden
    frozen = layers * layer + hidden + rows * hidden * (1 if tied else 2)
    lora = layers * rank * (2 * (hidden + hidden) + 2 * (hidden + kv) + 2 * (hidden + mlp) + (mlp + hidden))
    return frozen, lora


@pytest.mark.parametrize(("name", "dims"), [
    ("llama-3.2-1b-random", (2048, 512, 8192, 16, True)),
    ("llama-3.1-8b-random", (4096, 1024, 14336, 32, False)),
])
def test_a_shape_holds_its_frozen_weights_and_lora_as_counted_by_hand(name: str, dims: tuple) -> None:
    frozen, lora = by_hand(*dims)
    hidden, layers = dims[0], dims[3]
    memory = model_memory(shape(name), row_tokens=1024)
    token_rows = 16 * hidden * (1 if dims[4] else 2)  # SEP, mask and 14 sentinels: in the embedding (and output)
    assert memory.frozen_bytes == 2 * frozen  # bf16
    assert memory.trained_params == lora + token_rows
    # packing's estimate: 1.5 x 34 x hidden x layers, and half the tokens' fp32 logits and their gradient
    assert memory.row_bytes == int(1024 * (1.5 * 34 * hidden * layers + 0.5 * 10 * VOCAB))


@pytest.mark.parametrize(("name", "card_gib", "stage"), [
    ("llama-3.2-1b-random", 80, 2),
    ("llama-3.2-1b-random", 24, 2),
    ("llama-3.1-8b-random", 80, 2),
    ("llama-3.1-8b-random", 24, 3),  # 16.1 GB of weights + 1.3 GB of optimizer + 7.5 GB a 1,024-token row > 0.9 x 24
])
def test_auto_takes_zero3_only_where_the_model_and_a_row_do_not_fit_one_card(name: str, card_gib: int,
                                                                             stage: int) -> None:
    train = TrainConfig(num_workers=4)
    memory = model_memory(shape(name), planned_row_tokens(train, max_length=512))
    assert auto_zero_stage(memory, card_gib * GIB, workers=4) == stage
    assert auto_zero_stage(memory, card_gib * GIB, workers=1) == 2  # one worker: nothing to partition across
    assert auto_zero_stage(memory, None, workers=4) == 2  # CPU: no card to fit


def test_the_fit_counts_weights_optimizer_and_row() -> None:
    card = 10 * GIB
    fits = TrainingMemory(frozen_bytes=4 * GIB, trained_params=GIB // OPTIMIZER_BYTES_PER_TRAINED, row_bytes=4 * GIB)
    assert fits.total == 9 * GIB and auto_zero_stage(fits, card, workers=2) == 2  # 9 GiB <= 0.9 x 10 GiB
    over = TrainingMemory(frozen_bytes=4 * GIB, trained_params=GIB // OPTIMIZER_BYTES_PER_TRAINED, row_bytes=5 * GIB)
    assert auto_zero_stage(over, card, workers=2) == 3


def test_planned_row_is_the_smallest_the_run_may_take() -> None:
    assert planned_row_tokens(TrainConfig(pack_tokens=8192), 512) == 8192
    assert planned_row_tokens(TrainConfig(pack_tokens="auto"), 512) == 1024  # auto shrinks down to 1,024
    assert planned_row_tokens(TrainConfig(pack_tokens="auto"), 1536) == 1536  # but holds the longest sample
    assert planned_row_tokens(TrainConfig(pack_tokens=None, micro_batch_size=4), 512) == 2048


def test_zero3_settings_gather_a_decoder_layer_at_a_time_and_prefetch_the_next() -> None:
    model = shape("llama-3.2-1b-random")
    layer = model.get_base_model().model.layers[0]
    vocabulary = vocabulary_elements(model)
    zero = deepspeed_config(TrainConfig(zero_stage=3), bf16=True, layer=layer, vocabulary=vocabulary)[
        "zero_optimization"]
    layer_params = sum(p.numel() for p in layer.parameters())  # frozen 60.8M + LoRA 1.4M
    assert zero["stage"] == 3 and zero["leaf_module"] == {
        "classes": ["transformers.models.llama.modeling_llama.LlamaDecoderLayer"]}
    assert zero["stage3_prefetch_bucket_size"] == 2 * layer_params > 5e7  # DeepSpeed's default holds less than a layer
    # the tied embedding and output matrix counted once (with the token rows), and room for them beside DeepSpeed's 1e9
    matrix = 128_256 * 2048
    assert matrix < vocabulary < matrix + 2048 * 64
    assert zero["stage3_max_live_parameters"] == 10**9 + vocabulary
    assert zero["stage3_param_persistence_threshold"] == 0  # nothing persistent: no per-tensor gathers after a step
    two = deepspeed_config(TrainConfig(zero_stage=2), bf16=True)["zero_optimization"]
    assert two == {"stage": 2, "contiguous_gradients": False}
    with pytest.raises(ValueError, match="auto"):
        deepspeed_config(TrainConfig(zero_stage="auto"), bf16=True)


def test_a_zero3_engine_marks_the_decoder_layers_leaves_and_partitions_every_parameter() -> None:
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.utils import z3_leaf_module
    from test_train import experiment, tiny_peft_model

    from clozemath.train.compilation import decoder_layers
    from clozemath.train.distributed import init_distributed
    from clozemath.train.step import build_engine

    model = tiny_peft_model()
    init_distributed(torch.device("cpu"))
    build_engine(model, experiment("mft", zero_stage=3).train, total_steps=4, warmup_steps=1)
    assert all(z3_leaf_module(layer) for layer in decoder_layers(model))
    trained = [p for p in model.parameters() if p.requires_grad]
    frozen_matrices = [p for name, p in model.named_parameters() if "layers." in name and p.ds_numel >= 64 * 64]
    assert trained and frozen_matrices
    assert not any(p.ds_persist for p in model.parameters())  # LoRA's and the token rows travel with their layer
    # DeepSpeed's memory-efficient linear (which a compiled layer guards on, per layer) is left out
    assert torch.nn.functional.linear is not zero3_linear_wrap


def test_a_cpu_run_resolves_auto_to_zero2_and_keeps_a_set_stage() -> None:
    from test_train import experiment, tiny_peft_model

    from clozemath.train.layout import resolved_zero_stage

    model = tiny_peft_model()
    resolved = resolved_zero_stage(experiment(zero_stage="auto"), model, torch.device("cpu"))
    assert resolved.train.zero_stage == 2
    assert resolved_zero_stage(experiment(zero_stage=3), model, torch.device("cpu")).train.zero_stage == 3


class _LayoutReached(Exception):
    """The training loop got past its ZeRO stage to the layout: far enough for these tests."""


def test_a_worker_decides_its_stage_once_and_warns_of_a_needless_zero3_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a Ray worker runs (`ray_jobs.train.train_worker`): the stage is decided before its evaluation during
    training is set up, then the training loop keeps the stage it is given. Two workers, rank 0, on a card of 80 GiB
    (then of 1 MiB): a set ZeRO-3 of the tiny model, which fits the first, is warned about once; not on the second."""
    import io
    from types import SimpleNamespace

    from test_train import PAD, SPECIALS, experiment, tiny_peft_model

    from clozemath import console
    from clozemath.train import layout, loop

    err = io.StringIO()
    monkeypatch.setattr(console, "_console", console.Console(io.StringIO(), err))
    two_ranks = SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: 2, get_rank=lambda: 0)
    monkeypatch.setattr(layout, "dist", two_ranks)
    monkeypatch.setattr(loop, "dist", two_ranks)
    monkeypatch.setattr(loop, "init_distributed", lambda device: None)

    def reached(*args: object, **kwargs: object) -> None:
        raise _LayoutReached

    monkeypatch.setattr(loop, "training_layout", reached)
    model = tiny_peft_model()
    for card, warnings in ((80 * GIB, 1), (2**20, 0)):
        monkeypatch.setattr(layout, "card_bytes", lambda _device, _share, card=card: card)
        err.truncate(0)
        err.seek(0)
        config = layout.resolved_zero_stage(experiment(zero_stage=3), model, torch.device("cpu"))
        assert config.train.zero_stage == 3
        with pytest.raises(_LayoutReached):
            loop.train(model, [{"input_ids": [1, 2]}], config, specials=SPECIALS, pad_id=PAD, report=lambda *_: None)
        assert err.getvalue().count("train.zero_stage=3") == warnings, err.getvalue()
        if warnings:
            assert "fit one card (80 GiB)" in err.getvalue()
