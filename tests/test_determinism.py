"""Reproducible seeds: the seed reaches LoRA's initialisation, the data order, dropout and MFT's noise (the same seed
draws the same, another seed draws otherwise), and `train.deterministic` runs of one config give the same adapter bit
for bit: in one process (fast) and through Ray Train's workers (slow)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from clozemath import tracking
from clozemath.model.load import load_model
from clozemath.records import ADAPTER_DIR
from clozemath.train.determinism import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_ENV, deterministic_kernels
from clozemath.train.loop import train
from clozemath.train.step import TargetLoss
from test_model import tiny_config
from test_train import PAD, SPECIALS, Recorder, copy_rows, experiment, smoke_config, tiny_peft_model

ADAPTER_FILE = "adapter_model.safetensors"


def adapter_bits(folder: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    """Each tensor of a saved adapter: its dtype, shape and bytes."""
    return {name: (t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
            for name, t in load_file(folder / ADAPTER_FILE).items()}


def differing_tensors(a: Path, b: Path) -> list[str]:
    first, second = adapter_bits(a), adapter_bits(b)
    assert first.keys() == second.keys() and first
    return [name for name in first if first[name] != second[name]]


def lora_init(seed: int, drawn_before: int) -> dict[str, torch.Tensor]:
    """LoRA's A matrices (B starts at zero) of the tiny model loaded for training at `seed`, after `drawn_before`
    numbers were drawn from torch's global generator."""
    torch.rand(drawn_before)
    model = load_model(tiny_config(tied=False), 2, seed=seed).model
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_A" in name}


def test_the_seed_alone_decides_loras_initialisation() -> None:
    first, again, other = lora_init(0, drawn_before=1), lora_init(0, drawn_before=7), lora_init(1, drawn_before=1)
    assert first.keys() == other.keys() and len(first) == 14  # 7 projections x 2 layers
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not any(torch.equal(first[name], other[name]) for name in first)


def what_training_sees(
    folder: Path, seed: int, rows: list[dict[str, Any]], method: str, dropout: float, steps: int = 3
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The token ids the model is given at each step (its rows, MFT's noise in them), and the outputs of LoRA's
    dropout in the first step's forward, when the loop trains the tiny model at `seed` (checkpoints under
    `folder`)."""
    inputs: list[torch.Tensor] = []
    dropped: list[torch.Tensor] = []
    forward = TargetLoss.forward

    def seen(self: TargetLoss, input_ids: torch.Tensor, labels: torch.Tensor, **masks: Any) -> torch.Tensor:
        inputs.append(input_ids.detach().clone())
        return forward(self, input_ids, labels, **masks)

    def keep_first_steps(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        if len(inputs) == 1:
            dropped.append(output.detach().clone())

    model = tiny_peft_model(dropout=dropout)  # the same initialisation at every seed: only the loop's draws differ
    hooks = [module.register_forward_hook(keep_first_steps) for name, module in model.named_modules()
             if isinstance(module, torch.nn.Dropout) and "lora" in name]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TargetLoss, "forward", seen)
        train(model, rows, experiment(method, seed=seed, max_steps=steps, checkpoint_every=steps), specials=SPECIALS,
              pad_id=PAD, report=Recorder(folder))
    for hook in hooks:
        hook.remove()
    return inputs, dropped


def same(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(torch.equal(a, b) for a, b in zip(first, second))


def test_the_seed_decides_the_data_order(tmp_path: Path) -> None:
    rows = copy_rows(24)
    first, again, other = (what_training_sees(tmp_path / name, seed, rows, "prefix_lm", dropout=0.0)[0]
                           for name, seed in (("first", 0), ("again", 0), ("other", 1)))
    assert len(first) == 3 and same(first, again) and not same(first, other)


def test_the_seed_decides_dropout_and_mfts_noise(tmp_path: Path) -> None:
    """Every row alike, so the order cannot tell the seeds apart. The first step's forward is the base model's at any
    LoRA initialisation (B starts at zero) and MFT's rate starts at 0: what its dropout drops is the seed's alone;
    the later steps' token ids differ by MFT's noise alone."""
    row = {"input_ids": [5] * 8 + [2] + [7] * 60, "labels": [-100] * 9 + [7] * 60, "prefix_len": 9}
    first_inputs, first_dropped = what_training_sees(tmp_path / "first", 0, [row] * 8, "mft", dropout=0.3)
    again_inputs, again_dropped = what_training_sees(tmp_path / "again", 0, [row] * 8, "mft", dropout=0.3)
    other_inputs, other_dropped = what_training_sees(tmp_path / "other", 1, [row] * 8, "mft", dropout=0.3)
    assert len(first_dropped) == 14 and any(bool((out == 0).any()) for out in first_dropped)  # dropout ran
    assert same(first_dropped, again_dropped) and not any(map(torch.equal, first_dropped, other_dropped))
    assert torch.equal(first_inputs[0], other_inputs[0])  # no noise in the first step
    noised = [(ids != torch.tensor(row["input_ids"])).any() for ids in first_inputs[1:]]
    assert all(noised) and same(first_inputs, again_inputs) and not same(first_inputs[1:], other_inputs[1:])


def train_adapter(tmp_path: Path, name: str, seed: int, **settings: Any) -> Path:
    """The adapter a deterministic run of the loop writes (the tiny model with dropout, MFT's noise, 2 micro-batches a
    step)."""
    recorder = Recorder(tmp_path / name)
    config = experiment("mft", seed=seed, deterministic=True, max_steps=4, grad_accum=2, checkpoint_every=4, **settings)
    train(tiny_peft_model(seed=seed, dropout=0.1), copy_rows(24), config, specials=SPECIALS, pad_id=PAD,
          report=recorder)
    return recorder.checkpoints[4] / ADAPTER_DIR


@pytest.mark.parametrize("stage", [2, 3])
def test_deterministic_runs_give_the_same_adapter_bit_for_bit_and_other_seeds_another(tmp_path: Path,
                                                                                      stage: int) -> None:
    first = train_adapter(tmp_path, "first", 0, zero_stage=stage)
    assert not torch.are_deterministic_algorithms_enabled()  # the process's settings are given back
    assert differing_tensors(first, train_adapter(tmp_path, "again", 0, zero_stage=stage)) == []
    other = differing_tensors(first, train_adapter(tmp_path, "other", 1, zero_stage=stage))
    assert len(other) == len(adapter_bits(first))  # every tensor: LoRA's A from the start, B and the rows by training


def test_deterministic_kernels_are_switched_on_within_and_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CUBLAS_WORKSPACE_ENV, raising=False)
    with deterministic_kernels(True):
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ[CUBLAS_WORKSPACE_ENV] == CUBLAS_WORKSPACE == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert CUBLAS_WORKSPACE_ENV not in os.environ
    with deterministic_kernels(False):
        assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.slow
def test_deterministic_runs_through_ray_train_give_the_same_adapter(
    smoke_samples: Path, tmp_path: Path, ray_session: None
) -> None:
    """Two `train.deterministic` runs of the smoke config (2 ZeRO-2 workers on gloo, rows through Ray Data's streaming
    split, LoRA dropout on), each in a Train run of its own: the same adapter, every tensor bit for bit."""
    from ray_jobs.run import run_experiment

    shutil.copytree(smoke_samples, tmp_path / "runs" / "cache")
    adapters = []
    for name in ("first", "again"):
        config = smoke_config(tmp_path, f"name={name}", "train.deterministic=true", "train.stream_above_mb=0",
                              "model.lora.dropout=0.1", "eval.sets=[]")
        outcome = run_experiment(config)
        assert outcome.adapter is not None and outcome.prepared is not None and outcome.prepared.from_cache
        adapters.append(outcome.adapter)
        run = tracking.client(config.tracking.uri).get_run(outcome.run_id)
        assert run.data.params["train.deterministic"] == "True"
    assert differing_tensors(*adapters) == []


@pytest.mark.slow
def test_a_training_set_prepared_afresh_has_its_rows_in_the_same_order(
    tmp_path: Path, ray_session: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers' data order is a function of the seed and their rows' order: the cache's rows come in the problems'
    order however Ray Data's tasks and encoders (several blocks, up to 4 actors) finish."""
    from ray_jobs import preprocess

    monkeypatch.setattr(preprocess, "PROBLEMS_PER_BLOCK", 2)
    monkeypatch.setattr(preprocess, "ENCODE_BATCH", 8)
    config = smoke_config(tmp_path, "data.limit=12")
    first, again = (preprocess.preprocess(config, tmp_path / name) for name in ("first", "again"))
    assert not first.from_cache and not again.from_cache and first.num_rows > 40
    assert first.table().equals(again.table())
