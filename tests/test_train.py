"""Training: the DeepSpeed loop on a tiny random Llama (fast, in-process), then Ray Train end to end (slow)."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from clozemath import records, tracking
from clozemath_cli import main
from clozemath.config import ExperimentConfig, MethodConfig, ModelConfig, TrainConfig
from clozemath.data.tokenize import EOS, MASK, SEP, SpecialTokens, collate
from clozemath.errors import ClozeMathError
from clozemath.model.load import load_for_inference
from clozemath.plan import load_config
from clozemath.records import readable_params
from clozemath.train.batches import epoch_micro_batches, model_inputs
from clozemath.train.checkpoint import full_trainable_parameters
from clozemath.train.loop import StepMetrics, train
from clozemath.train.flops import MFU_CONVENTION, TrainingShape, sample_flops
from clozemath.train.step import TargetLoss, target_positions
from ray_jobs.cluster import FOOTER_ACTORS, FOOTER_ACTORS_ENV_VAR, TRAIN_POLL_ENV_VAR, TRAIN_POLL_S, runtime_env
from clozemath.data.prepare import prepare_data, training_samples
from clozemath.data.sources import load_problems
from ray_jobs import preprocess as preprocess_module
from ray_jobs.preprocess import TokenizedSet, cache_key, preprocess
from ray_jobs.run import run_experiment
from ray_jobs.train import node_gpus, preflight_checks, rows_of_rank, streams, worker_threads
from conftest import EVERY_4_STEPS, LEARNS, SMOKE, SmokeRun

VOCAB = 300
PAD = 0
SPECIALS = SpecialTokens(
    tokens={SEP: SEP, MASK: MASK}, ids={SEP: 2, MASK: 1, EOS: 0}, added=True, ordinary_ids=tuple(range(3, VOCAB))
)


def tiny_peft_model(seed: int = 0, tied: bool = False, layers: int = 2, dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, initializer_range=0.2,
    )
    model = LlamaForCausalLM(config)
    rows = [1, 2] if tied else {"embed_tokens": [1, 2], "lm_head": [1, 2]}
    lora = PeftLoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=dropout,
                          trainable_token_indices=rows)
    return get_peft_model(model, lora)


def copy_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Learnable synthetic samples: a random prefix, then its tokens mapped onto a 4-token alphabet.

    (The tiny model has `initializer_range=0.2`: with the default 0.02 its final norm caps the logits too low for the
    loss to fall far.)"""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 10, (1,), generator=generator))
        prefix = torch.randint(3, 40, (length,), generator=generator).tolist() + [2]
        target = [3 + t % 4 for t in prefix[:-1]]
        rows.append({"input_ids": prefix + target, "labels": [-100] * len(prefix) + target, "prefix_len": len(prefix)})
    return rows


def experiment(method: str = "prefix_lm", **train: Any) -> ExperimentConfig:
    methods = {
        "prefix_lm": MethodConfig(name="it_prefixlm", attention="prefix_lm"),
        "mft": MethodConfig(name="mft", attention="causal", mft={"r_max": 0.4, "noise": "random"}),
    }
    settings = {"micro_batch_size": 4, "lr": 3e-2, "warmup_ratio": 0.1, "checkpoint_every": 3, **train}
    return ExperimentConfig(
        name="loop",
        model=ModelConfig(name="tiny", tokenizer="unused", random_init={}),
        method=methods[method],
        train=TrainConfig(**settings),
    )


class Recorder:
    """A `report` callback that keeps the metrics and copies every checkpoint folder it is shown."""

    def __init__(self, keep: Path) -> None:
        self.metrics: list[StepMetrics] = []
        self.checkpoints: dict[int, Path] = {}
        self.keep = keep

    def __call__(self, metrics: StepMetrics, checkpoint: Path | None) -> None:
        self.metrics.append(metrics)
        if checkpoint is not None:
            import shutil

            target = self.keep / f"step_{metrics.step}"
            shutil.copytree(checkpoint, target)
            self.checkpoints[metrics.step] = target


def trainable_state(engine: Any) -> dict[str, torch.Tensor]:
    """The trainable parameters' values, gathered whole under ZeRO-3 (where each rank holds a shard, and the
    parameter itself an empty placeholder)."""
    with full_trainable_parameters(engine):
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    assert all(value.numel() > 0 for value in state.values())
    return state


def assert_adapter_holds(folder: Path, engine: Any) -> None:
    """The saved adapter's tensors are the trained values (LoRA matrices and special-token rows)."""
    with full_trainable_parameters(engine):
        trained = get_peft_model_state_dict(engine.module.model, save_embedding_layers=False)
        trained = {name: value.detach().clone() for name, value in trained.items()}
    saved = load_file(folder / "adapter_model.safetensors")
    assert saved.keys() == trained.keys() and any("trainable_tokens" in name for name in saved)
    for name, value in saved.items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0)
    assert any(value.abs().sum() > 0 for name, value in saved.items() if "lora_B" in name)  # B starts at zero


def padding(lengths: list[int], batches: list[list[int]]) -> int:
    return sum(len(batch) * max(lengths[i] for i in batch) - sum(lengths[i] for i in batch) for batch in batches)


@pytest.mark.parametrize(("tied", "method"), [(False, "prefix_lm"), (True, "prefix_lm"), (False, "mft")])
def test_target_loss_equals_the_models_own_loss_and_gradients(tied: bool, method: str) -> None:
    model = tiny_peft_model(tied=tied).eval()  # no dropout: both passes see the same network
    batch = collate(copy_rows(6, seed=3), PAD)
    inputs = model_inputs(batch, experiment(method), model, packed=False)
    ours = TargetLoss(model)(**inputs, positions=target_positions(batch["labels"]))  # as training calls it
    ours.backward()
    ours_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    theirs = model(**inputs).loss
    theirs.backward()
    assert torch.allclose(ours, theirs, atol=1e-6)
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.allclose(ours_grads[name], param.grad, atol=1e-6), name


def test_epoch_micro_batches_cover_each_row_once_and_grouping_pads_less() -> None:
    lengths = torch.randint(50, 400, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    plain = epoch_micro_batches(lengths, 124, 8, seed=1, epoch=0, group_by_length=False)
    grouped = epoch_micro_batches(lengths, 124, 8, seed=1, epoch=0, group_by_length=True)
    for batches in (plain, grouped):
        rows = [i for batch in batches for i in batch]
        assert len(batches) == 124 and all(len(b) == 8 for b in batches) and len(set(rows)) == len(rows) == 992
    assert sorted(i for b in grouped for i in b) == sorted(i for b in plain for i in b)  # same rows, other batches
    assert padding(lengths, grouped) < 0.2 * padding(lengths, plain)
    assert epoch_micro_batches(lengths, 124, 8, seed=1, epoch=1, group_by_length=True) != grouped


@pytest.mark.parametrize(("stage", "method"), [(2, "prefix_lm"), (3, "mft")])
def test_loop_loss_falls_and_resume_is_exact(tmp_path: Path, stage: int, method: str) -> None:
    """Resuming from the step-3 checkpoint replays steps 4..8 exactly (same data, dropout, MFT noise, weights) and
    counts the tokens trained before it."""
    config = experiment(method, zero_stage=stage, max_steps=8, grad_accum=2)
    rows = copy_rows(24)

    straight = Recorder(tmp_path / "straight")
    engine = train(tiny_peft_model(), rows, config, specials=SPECIALS, pad_id=PAD, report=straight)
    losses = [m.loss for m in straight.metrics]
    assert [m.step for m in straight.metrics] == list(range(1, 9))
    assert losses[-1] < 0.8 * losses[0], losses
    so_far = list(itertools.accumulate(m.tokens for m in straight.metrics))
    assert [m.trained_tokens for m in straight.metrics] == so_far
    assert sorted(straight.checkpoints) == [3, 6, 8]
    assert (straight.checkpoints[8] / "adapter" / "adapter_model.safetensors").is_file()
    assert not (straight.checkpoints[6] / "adapter").exists()
    final = trainable_state(engine)
    assert_adapter_holds(straight.checkpoints[8] / "adapter", engine)

    resumed = Recorder(tmp_path / "resumed")
    engine = train(tiny_peft_model(), rows, config, specials=SPECIALS, pad_id=PAD, report=resumed,
                   resume_from=straight.checkpoints[3])
    assert [m.step for m in resumed.metrics] == [4, 5, 6, 7, 8]
    assert [m.loss for m in resumed.metrics] == pytest.approx(losses[3:], rel=1e-5)
    assert [m.trained_tokens for m in resumed.metrics] == [m.trained_tokens for m in straight.metrics[3:]]
    for name, value in trainable_state(engine).items():
        torch.testing.assert_close(value, final[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["prefix_lm", "mft"])
def test_each_step_logs_its_mfu_where_the_cards_peak_is_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """On a card of 1 TFLOP/s, a step's MFU is the training FLOPs of the rows it took (`sample_flops`, worked out by
    hand in test_flops.py; PrefixLM's attention or causal, by the method) over its seconds and that peak. Every row
    is alike here, so a step's FLOPs are its rows (tokens / 29) times one row's."""
    row = {"input_ids": [5] * 8 + [2] + [7] * 20, "labels": [-100] * 9 + [7] * 20, "prefix_len": 9}
    monkeypatch.setattr("clozemath.train.loop.peak_flops", lambda device: 1e12)
    model = tiny_peft_model()
    per_row = sample_flops(TrainingShape.of(model), row, prefix_lm=method == "prefix_lm")
    recorder = Recorder(tmp_path)
    train(model, [row] * 8, experiment(method, max_steps=3, checkpoint_every=3), specials=SPECIALS, pad_id=PAD,
          report=recorder)
    assert len(recorder.metrics) == 3
    for metrics in recorder.metrics:
        rows = metrics.tokens / 29
        assert rows == 4  # micro_batch_size 4, one micro-batch a step
        assert metrics.mfu == pytest.approx(rows * per_row / metrics.seconds / 1e12, rel=1e-9)
        assert metrics.as_dict()["train/mfu"] == metrics.mfu


@pytest.mark.slow
def test_compiled_layers_under_zero3_compile_once_and_train_as_eager_ones(tmp_path: Path) -> None:
    """ZeRO-3 hooks gather and release each layer's weights: compiled with the layer, they were traced and compiled
    again for every layer. Now one frame is compiled for all three layers, and the losses are the eager run's."""
    rows = copy_rows(16)
    losses = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        recorder = Recorder(tmp_path / str(compiled))
        config = experiment(zero_stage=3, max_steps=3, pack_tokens=128, compile=compiled)
        train(tiny_peft_model(layers=3, dropout=0.0), rows, config, specials=SPECIALS, pad_id=PAD, report=recorder)
        losses[compiled] = [m.loss for m in recorder.metrics]
    assert torch._dynamo.utils.counters["frames"]["total"] == 1
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def cosine_with_warmup(step: int, total: int, warmup: int, peak: float) -> float:
    """The learning rate of optimizer step `step` (1-based): linear from 0 over `warmup` steps, then a half cosine
    from `peak` to 0 over the rest (transformers' `get_cosine_schedule_with_warmup`, written out)."""
    done = step - 1
    if done < warmup:
        return peak * done / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (done - warmup) / (total - warmup)))


@pytest.mark.parametrize(("warmup_ratio", "grad_accum"), [(0.25, 1), (0.1, 2)])
def test_logged_lr_is_the_cosine_schedule_with_warmup_of_each_step(
    tmp_path: Path, warmup_ratio: float, grad_accum: int
) -> None:
    config = experiment(max_steps=10, warmup_ratio=warmup_ratio, lr=1e-2, grad_accum=grad_accum, checkpoint_every=10)
    recorder = Recorder(tmp_path)
    train(tiny_peft_model(), copy_rows(24), config, specials=SPECIALS, pad_id=PAD, report=recorder)
    warmup = math.ceil(warmup_ratio * 10)
    assert [m.lr for m in recorder.metrics] == pytest.approx(
        [cosine_with_warmup(step, 10, warmup, 1e-2) for step in range(1, 11)], abs=1e-9
    )


def test_mft_noise_reaches_the_model_at_the_scheduled_rate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The token ids the model sees in training: the targets replaced at about min(r_max, r_max * step /
    (0.66 * total + 1)) (labels unchanged), the prefix never; without MFT, untouched."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward = TargetLoss.forward

    def spy(self: TargetLoss, input_ids: torch.Tensor, labels: torch.Tensor, **masks: Any) -> torch.Tensor:
        seen.append((input_ids.detach().clone(), labels.detach().clone()))
        return forward(self, input_ids, labels, **masks)

    monkeypatch.setattr(TargetLoss, "forward", spy)
    rows = [{"input_ids": [5] * 8 + [2] + [7] * 200, "labels": [-100] * 9 + [7] * 200, "prefix_len": 9}] * 8
    total, r_max = 6, 0.4
    train(tiny_peft_model(), rows, experiment("mft", max_steps=total, checkpoint_every=total), specials=SPECIALS,
          pad_id=PAD, report=Recorder(tmp_path))
    assert len(seen) == total
    for step, (input_ids, labels) in enumerate(seen):
        target = labels != -100
        assert torch.equal(input_ids[~target], torch.tensor([5] * 8 + [2]).repeat(4))  # the prefix is never noised
        changed = float((input_ids[target] != 7).float().mean())
        expected = min(r_max, r_max * step / (0.66 * total + 1))
        assert abs(changed - expected) < 0.06, (step, changed, expected)  # 800 targets: sd 0.017 at most
        assert torch.equal(labels[target], torch.full_like(labels[target], 7))
    assert float((seen[-1][0][seen[-1][1] != -100] != 7).float().mean()) > 0.2  # noise at the end of training

    seen.clear()
    train(tiny_peft_model(), rows, experiment(max_steps=2, checkpoint_every=2), specials=SPECIALS, pad_id=PAD,
          report=Recorder(tmp_path / "plain"))
    assert all(torch.equal(ids, torch.tensor(rows[0]["input_ids"]).repeat(4, 1)) for ids, _ in seen)


def test_checkpoint_leaves_frozen_weights_out_tied_ones_too(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    model = tiny_peft_model(tied=True)
    train(model, copy_rows(8), experiment(max_steps=1), specials=SPECIALS, pad_id=PAD, report=recorder)
    saved = torch.load(recorder.checkpoints[1] / "state" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    engine_module = TargetLoss(model)  # what the engine wraps, so its names start with `model.`
    trainable = {name for name, p in engine_module.named_parameters(remove_duplicate=False) if p.requires_grad}
    buffers = {name for name, _ in engine_module.named_buffers()}
    assert trainable <= saved.keys() <= trainable | buffers, sorted(saved.keys() - trainable - buffers)


# --------------------------------------------------------------------------------------------------------------
# Ray end to end: `clozemath run` on the smoke config, 2 workers (slow)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("train")


def smoke_config(workdir: Path, *overrides: str) -> ExperimentConfig:
    base = [f"train.output_dir={workdir / 'runs'}", f"tracking.uri=sqlite:///{workdir / 'mlruns.db'}"]
    config = load_config(SMOKE, [*base, *LEARNS, *overrides])
    assert isinstance(config, ExperimentConfig)
    return config


def logged_steps(config: ExperimentConfig, run_id: str) -> list[tuple[int, float]]:
    history = tracking.client(config.tracking.uri).get_metric_history(run_id, "train/loss")
    return [(m.step, m.value) for m in sorted(history, key=lambda m: m.timestamp)]


def assert_loss_falls(losses: list[float]) -> None:
    assert sum(losses[-2:]) < 0.95 * sum(losses[:2]), losses


def assert_adapter_reloads_and_generates(config: ExperimentConfig, adapter: Path) -> None:
    from safetensors.torch import load_file

    weights = load_file(adapter / "adapter_model.safetensors")
    lora_b = [tensor for name, tensor in weights.items() if "lora_B" in name]
    assert lora_b and all(t.numel() > 0 for t in weights.values())  # gathered in full under ZeRO-3
    assert any(t.abs().sum() > 0 for t in lora_b)  # trained (B starts at zero)
    assert any("trainable_tokens" in name for name in weights)

    loaded = load_for_inference(config.model, adapter, "cpu")
    prompt = loaded.tokenizer("Question: 2+3?\nAnswer:", return_tensors="pt")
    out = loaded.model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 4


@pytest.mark.slow
def test_preprocess_is_cached(smoke_prepared: TokenizedSet, workdir: Path) -> None:
    """The first preparation of the smoke samples is the session's (`smoke_prepared`, tests/conftest.py)."""
    config = smoke_config(workdir)
    first = smoke_prepared
    second = preprocess(config, first.folder.parent)
    assert (first.from_cache, second.from_cache) == (False, True)
    assert second.folder == first.folder and second.num_rows == first.num_rows == sum(first.kinds.values())
    assert set(first.kinds) == {"lm", "cloze"} and first.num_sentinels > 0
    rows = first.dataset().take_all()
    assert len(rows) == first.num_rows
    as_lists = lambda row: {name: list(value) if name != "prefix_len" else value for name, value in row.items()}  # noqa: E731
    assert first.table().to_pylist() == [as_lists(row) for row in rows]  # a small set's rows: Ray Data's, in order
    for row in rows:
        labels = list(row["labels"])
        assert labels[: row["prefix_len"]] == [-100] * row["prefix_len"]
        assert all(label != -100 for label in labels[row["prefix_len"] :])

    local = prepare_data(config)  # the pipeline on one machine, without Ray: the same token ids, the same kinds
    as_tuples = lambda ids, labels, cut: (tuple(ids), tuple(labels), int(cut))  # noqa: E731
    assert Counter(as_tuples(r["input_ids"], r["labels"], r["prefix_len"]) for r in rows) == Counter(
        as_tuples(e["input_ids"], e["labels"], e["prefix_len"]) for e in local.encoded if e is not None
    )
    assert local.summary(config.data.max_length)["sentinels_needed"] == first.num_sentinels

    problems = load_problems("gsm8k", "train", limit=config.data.limit)
    for change in ("data.max_length=256", "data.seed=1", "method.lm_share=0.4", "data.prompt_template='Q: {question}'"):
        assert cache_key(smoke_config(workdir, change), problems) != cache_key(config, problems), change
    edited = workdir / "edited"
    edited.mkdir()
    lines = (Path(os.environ["CLOZEMATH_DATA_DIR"]) / "gsm8k" / "train.jsonl").read_text().splitlines(keepends=True)
    (edited / "train.jsonl").write_text(lines[0].replace("Natalia", "Natalie") + "".join(lines[1:4]))  # one letter
    third = preprocess(smoke_config(workdir, f"data.path={edited}"), workdir / "runs" / "cache")
    assert not third.from_cache and third.folder != first.folder


def method_at_seed(method: str, seed: int, *overrides: str) -> ExperimentConfig:
    """The smoke experiment with a method of configs/methods/ at a training seed, as a grid's axes make it (the data
    seed follows the training seed)."""
    config = load_config(SMOKE, [f"method={method}", f"train.seed={seed}", *overrides])
    assert isinstance(config, ExperimentConfig) and config.data.seed == seed
    return config


def test_a_tokenizer_or_weights_edited_in_place_change_the_runs_inputs_and_its_samples_key(tmp_path: Path) -> None:
    """A tokenizer folder edited where it is (its pre-tokenizer now splits numbers digit by digit) is another
    tokenizer: the run's inputs name it (so a resumed run is refused, and a trial's checkpoints are not resumed) and
    its samples are prepared afresh; weights over `WHOLE_FILE_BYTES` count by size and modification time, unread."""
    from clozemath.model.tokenizer import WHOLE_FILE_BYTES, local_files_identity, resolve_location
    from clozemath.plan import run_inputs

    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(resolve_location(load_config(SMOKE).model.tokenizer), tokenizer)
    config = smoke_config(tmp_path, f"model.tokenizer={tokenizer}")
    problems = load_problems("gsm8k", "train", limit=3)
    inputs, key = run_inputs([config]), cache_key(config, problems)
    assert run_inputs([config]).changes({"data": inputs.data}) == [] and cache_key(config, problems) == key
    text = (tokenizer / "tokenizer.json").read_text()
    assert "\\\\p{N}{1,3}" in text
    (tokenizer / "tokenizer.json").write_text(text.replace("\\\\p{N}{1,3}", "\\\\p{N}"))
    assert run_inputs([config]).changes({"data": inputs.data}) == [f"tokenizer at {tokenizer}: its data changed"]
    assert cache_key(config, problems) != key

    weights = tmp_path / "model"
    weights.mkdir()
    gguf = weights / "model.gguf"
    with gguf.open("wb") as handle:
        handle.truncate(WHOLE_FILE_BYTES + 1)  # sparse: never read
    model = ModelConfig(name="m", path=str(weights), gguf_file="model.gguf")
    before = local_files_identity(model)
    assert list(before) == [f"model at {weights}"] and local_files_identity(model) == before
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 1))
    assert local_files_identity(model) != before


def test_methods_whose_samples_are_alike_share_a_preprocessing_key() -> None:
    problems = load_problems("gsm8k", "train", limit=3)

    def key(method: str, seed: int, *overrides: str) -> str:
        return cache_key(method_at_seed(method, seed, *overrides), problems)

    assert len({key(method, seed) for method in ("it", "mft", "it_prefixlm") for seed in (0, 3)}) == 1
    assert key("clozemath", 0) == key("clozemath_causal", 0)
    assert key("clozemath", 3) == key("clozemath_causal", 3) != key("clozemath", 0)
    assert key("random_span", 0) != key("clozemath", 0)
    assert key("clozemath", 0, "method.lm_share=0.4") != key("clozemath", 0)
    assert key("it", 0, "method.lm_share=0.4") == key("it", 0)
    assert key("it", 0, "data.max_length=256") != key("it", 0)


def test_matched_budgets_prepare_each_shared_set_once() -> None:
    """`with_budgets` prepares one set per group it forms: the groups follow the cache key, so IT (the budget's
    reference), MFT and it_prefixlm at two seeds make one group, not six."""
    from clozemath.data.prepare import training_set_identity

    def groups(*methods: str) -> set[str]:
        return {training_set_identity(method_at_seed(method, seed)) for method in methods for seed in (0, 3)}

    assert len(groups("it", "mft", "it_prefixlm")) == 1
    assert len(groups("clozemath", "clozemath_causal")) == 2


def test_methods_sharing_a_key_make_the_same_samples() -> None:
    """What the keys above claim, on real GSM8K problems: the samples are built and compared."""
    problems = load_problems("gsm8k", "train", limit=6)

    def samples(method: str, seed: int) -> list[Any]:
        config = method_at_seed(method, seed)
        return training_samples(problems, config.method, config.data)

    it = samples("it", 0)
    assert it == samples("mft", 3) and len(it) == len(problems) and {s.kind for s in it} == {"lm"}
    cloze = samples("clozemath", 1)
    assert cloze == samples("clozemath_causal", 1) and {s.kind for s in cloze} == {"lm", "cloze"}


def test_an_identical_set_prepared_at_once_is_built_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads preparing one key: one builds, the other waits for it and reads its cache. Two different keys
    build at the same time (each build waits for the other to start: serialized builds would time out)."""
    builds: list[Path] = []
    both_building = threading.Barrier(2, timeout=10)

    def build(config: ExperimentConfig, problems: list[Any], folder: Path) -> dict[str, Any]:
        builds.append(folder)
        if config.method.name == "random_span":
            both_building.wait()
        time.sleep(0.3)
        (folder / "rows").mkdir()
        pq.write_table(pa.table({"input_ids": [[0]] * len(problems)}), folder / "rows" / "0.parquet")  # as many rows
        return {"num_rows": len(problems), "num_sentinels": 0, "kinds": {"lm": len(problems)},
                "dropped_for_length": 0, "num_tokens": 0}

    monkeypatch.setattr(preprocess_module, "_build", build)
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(max_workers=2) as pool:
        same = list(pool.map(lambda method: preprocess(method_at_seed(method, 0), cache), ["it", "mft"]))
    assert len(builds) == 1 and same[0].folder == same[1].folder and same[0].folder.parent == cache
    assert sorted(prepared.from_cache for prepared in same) == [False, True]
    assert (same[0].folder / "rows").is_dir() and not list(cache.glob(".*.building"))

    with ThreadPoolExecutor(max_workers=2) as pool:
        different = list(pool.map(
            lambda seed: preprocess(method_at_seed("random_span", seed), cache), [0, 1]
        ))
    assert len(builds) == 3 and different[0].folder != different[1].folder
    assert not any(prepared.from_cache for prepared in different)


@pytest.mark.slow
def test_prepare_and_the_run_make_the_same_token_ids(workdir: Path, ray_session: None) -> None:
    """`clozemath prepare` runs the run's preprocessing steps in its own process: for the same config, the same token
    ids, kinds and sentinels (random spans, drawn over the tokenizer's offsets on Ray's workers, included)."""
    config = smoke_config(workdir, "method=random_span")
    run = preprocess(config, workdir / "runs" / "cache")
    shown = prepare_data(config)
    kept = [(sample, row) for sample, row in zip(shown.samples, shown.encoded) if row is not None]
    as_tuples = lambda ids, labels, cut: (tuple(ids), tuple(labels), int(cut))  # noqa: E731
    ran = Counter(as_tuples(r["input_ids"], r["labels"], r["prefix_len"]) for r in run.dataset().take_all())
    assert ran == Counter(as_tuples(row["input_ids"], row["labels"], row["prefix_len"]) for _, row in kept)
    assert run.kinds == dict(Counter(sample.kind for sample, _ in kept)) and set(run.kinds) == {"lm", "random_span"}
    assert run.num_sentinels == shown.summary(config.data.max_length)["sentinels_needed"]


@pytest.mark.parametrize("name, ours", [(TRAIN_POLL_ENV_VAR, TRAIN_POLL_S), (FOOTER_ACTORS_ENV_VAR, FOOTER_ACTORS)])
def test_ray_train_collects_reports_briskly_and_ray_data_reads_footers_in_one_actor_unless_told_otherwise(
        monkeypatch: pytest.MonkeyPatch, name: str, ours: str) -> None:
    """Ray Train's 2 s default poll would make every step last 2 s (measured: 2.08 s a step of the smoke config);
    Ray Data's 32 footer readers cost every trial's first read of its few Parquet files seconds of process starts."""
    monkeypatch.delenv(name, raising=False)
    assert runtime_env()["env_vars"][name] == ours
    monkeypatch.setenv(name, "7")
    assert runtime_env()["env_vars"][name] == "7"


def assert_curve_at_steps_4_and_8(config: ExperimentConfig, run_id: str) -> None:
    client = tracking.client(config.tracking.uri)
    totals = client.get_metric_history(run_id, "curve/gsm8k/greedy/total")
    assert sorted((m.step, m.value) for m in totals) == [(4, 2.0), (8, 2.0)]
    for correct, accuracy in zip(*(sorted(client.get_metric_history(run_id, f"curve/gsm8k/greedy/{name}"),
                                          key=lambda m: m.step) for name in ("correct", "accuracy"))):
        assert correct.step == accuracy.step and accuracy.value == correct.value / 2


@pytest.mark.slow
def test_zero2_run_learns_and_is_tracked(smoke_run: SmokeRun) -> None:
    """The session's `clozemath run` of the smoke experiment, 2 ZeRO-2 workers (its console: tests/test_console.py)."""
    assert smoke_run.code == 0, "\n".join(smoke_run.lines)
    config = smoke_run.config()
    (run,) = tracking.find_runs(config.tracking, {"role": "trial"})
    run_id = run.info.run_id
    assert_curve_at_steps_4_and_8(config, run_id)

    steps = logged_steps(config, run_id)
    assert [step for step, _ in steps] == list(range(1, 9))
    assert_loss_falls([loss for _, loss in steps])
    adapter = smoke_run.folder / "runs" / "smoke" / "adapter"
    assert_adapter_reloads_and_generates(config, adapter)

    client = tracking.client(config.tracking.uri)
    assert run.info.status == "FINISHED"
    expected = readable_params(config)
    assert {key: run.data.params[key] for key in expected} == expected
    assert {key: run.data.params[key] for key in ("eval.sets", "eval.sets.gsm8k.limit", "eval.decodings")} == {
        "eval.sets": "gsm8k", "eval.sets.gsm8k.limit": "4", "eval.decodings": "greedy"  # smoke.yaml, as a person reads it
    }
    for name in records.TRAIN_METRICS:
        assert len(client.get_metric_history(run_id, name)) == 8, name
    assert not client.get_metric_history(run_id, "train/mfu")  # a CPU has no listed peak: no figure made up
    assert run.data.params["train.mfu_convention"] == MFU_CONVENTION
    assert records.compile_cache_folder(config).is_dir()  # the workers were pointed at the grid's compile cache
    artifacts = {info.path for info in client.list_artifacts(run_id)}
    assert {"config.yaml", "adapter", "eval"} <= artifacts
    evaluation = json.loads((records.eval_folder(config) / records.METRICS_FILE).read_text())
    assert run.data.metrics["eval/gsm8k/greedy/total"] == 4 == evaluation["eval/gsm8k/greedy/total"]
    [evaluated] = client.get_metric_history(run_id, "eval/gsm8k/greedy/accuracy")
    assert evaluated.step == 8  # evaluated after the last training step
    adapter_files = {info.path for info in client.list_artifacts(run_id, "adapter")}
    assert "adapter/adapter_model.safetensors" in adapter_files


@pytest.mark.slow
def test_zero3_worker_failure_resumes_from_checkpoint(smoke_samples: Path, workdir: Path) -> None:
    """Rank 0 fails before step 6; the workers restart from the step-4 checkpoint (step 5 is trained again; reported
    every step, its first try reaches MLflow before the failure) and stop at step 8; MLflow holds each step once, and
    the run's trained tokens are its 8 steps'.
    Both workers evaluate during training, before the failure and after the restart. The workers take their rows
    through Ray Data's streaming split (a set above `train.stream_above_mb`), after the restart too. The samples
    come from the session's (`smoke_samples`)."""
    config = smoke_config(workdir, "name=smoke_zero3", "train.zero_stage=3", "train.fail_at_step=6",
                          "train.stream_above_mb=0", "eval.sets=[{dataset: gsm8k, limit: 2}]", "train.report_every=1",
                          *EVERY_4_STEPS)
    assert config.train.checkpoint_every == 4 and config.train.max_steps == 8
    shutil.copytree(smoke_samples, workdir / "runs" / "cache", dirs_exist_ok=True)
    outcome = run_experiment(config)
    assert_curve_at_steps_4_and_8(config, outcome.run_id)

    steps = logged_steps(config, outcome.run_id)
    assert [step for step, _ in steps] == list(range(1, 9))
    assert_loss_falls([loss for _, loss in steps])
    assert_adapter_reloads_and_generates(config, outcome.adapter)
    # the tokens trained: every step's once, those before the checkpoint the restarted workers resumed from too
    client = tracking.client(config.tracking.uri)
    params = client.get_run(outcome.run_id).data.params
    tokens = {m.step: m.value for m in client.get_metric_history(outcome.run_id, "train/tokens")}
    assert params["train.trained_steps"] == "8" and int(params["train.trained_tokens"]) == sum(tokens.values())


# --------------------------------------------------------------------------------------------------------------
# One-line errors


@pytest.mark.parametrize(
    ("overrides", "culprit"),
    [
        (["model=smollm2-135m", "model.path=/nonexistent/model"], "/nonexistent/model"),
        (["model=smollm2-135m", "model.gguf_file=missing.Q4.gguf"], "missing.Q4.gguf"),
        (["train.zero_stage=1"], "train.zero_stage"),
    ],
)
def test_run_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str], culprit: str
) -> None:
    args = ["run", SMOKE, f"train.output_dir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path / 'm.db'}", *overrides]
    assert main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("clozemath: error:")]
    assert len(errors) == 1 and culprit in errors[0] and "Traceback" not in err, err


def test_preflight_refusals_are_user_errors() -> None:
    prepared = TokenizedSet(folder=Path("."), num_rows=10, num_tokens=1000, num_sentinels=0, kinds={"lm": 10},
                        dropped_for_length=0, from_cache=True)
    with pytest.raises(ClozeMathError, match="too few training samples"):
        preflight_checks(experiment(num_workers=2, micro_batch_size=8), prepared)
    with pytest.raises(ClozeMathError, match="fail_at_step"):
        preflight_checks(experiment(micro_batch_size=1, checkpoint_every=4, fail_at_step=3), prepared)


def test_a_small_training_set_goes_to_the_workers_as_one_object_in_equal_shares(tmp_path: Path) -> None:
    table = pa.table({"input_ids": [[3, i] for i in range(7)], "prefix_len": list(range(7))})
    shares = [rows_of_rank(table, rank, 2) for rank in range(2)]
    assert [[row["prefix_len"] for row in share] for share in shares] == [[0, 2, 4], [1, 3, 5]]
    assert shares[1][0] == {"input_ids": [3, 1], "prefix_len": 1}
    assert [row["prefix_len"] for row in rows_of_rank(table, 0, 1)] == list(range(7))

    (tmp_path / "rows").mkdir()
    pq.write_table(table, tmp_path / "rows" / "part-0.parquet")
    prepared = TokenizedSet(folder=tmp_path, num_rows=7, num_tokens=14, num_sentinels=0, kinds={"lm": 7},
                        dropped_for_length=0, from_cache=True)
    assert not streams(experiment(), prepared)  # a few bytes, under the default 64 MB
    assert streams(experiment(stream_above_mb=0), prepared)


def test_the_output_matrix_holds_the_trained_special_token_rows() -> None:
    """What the fused loss multiplies by: the output layer's matrix as the layer applies it (tied to the embedding,
    peft's trainable rows written over the frozen ones)."""
    from clozemath.train.step import output_matrix

    output = tiny_peft_model(tied=True).get_base_model().get_output_embeddings()
    with torch.no_grad():
        for delta in output.token_adapter.trainable_tokens_delta.parameters():
            delta.add_(1.0)
    hidden = torch.randn(5, 64)
    matrix = output_matrix(output)
    assert torch.allclose(output(hidden), hidden @ matrix.T, atol=1e-5)
    assert not torch.equal(matrix[1:3], output.token_adapter.base_layer.weight[1:3])
    assert matrix.requires_grad  # the special-token rows learn through it


def test_the_fused_loss_is_refused_in_one_line_where_it_cannot_run() -> None:
    from clozemath.train.step import use_fused_loss

    assert not use_fused_loss(TrainConfig(), torch.device("cpu"))  # auto: off on CPU
    with pytest.raises(ClozeMathError, match=r"^train.fused_loss=true needs (liger-kernel|a GPU)"):
        use_fused_loss(TrainConfig(fused_loss=True), torch.device("cpu"))


def test_a_worker_gets_threads_in_proportion_to_its_share_of_the_node() -> None:
    assert worker_threads(16, 1, None, 0.0) == 16  # a CPU worker: the node's cores
    assert worker_threads(2, 2, None, 0.0) == 1
    assert worker_threads(16, 1, 1.0, 1.0) == 16  # Ray would give a 1-CPU GPU worker one thread
    assert worker_threads(32, 1, 0.25, 2.0) == 4  # 8 trials of a quarter GPU on 2 GPUs share 32 cores
    assert worker_threads(4, 1, 0.25, 2.0) == 1


def test_a_process_finds_its_own_node_among_rays_nodes(ray_session: None) -> None:
    import ray

    assert node_gpus() == ray.cluster_resources().get("GPU", 0.0)  # one node: its GPUs are the cluster's
