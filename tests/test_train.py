"""Training: the DeepSpeed loop on a tiny random Llama (fast, in-process), then Ray Train end to end (slow)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from clozemath.config import ExperimentConfig, MethodConfig, ModelConfig, TrainConfig
from clozemath.data.tokenize import EOS, MASK, SEP, SpecialTokens
from clozemath.train.loop import StepMetrics, train

VOCAB = 300
PAD = 0
SPECIALS = SpecialTokens(tokens={SEP: SEP, MASK: MASK}, ids={SEP: 2, MASK: 1, EOS: 0}, added=True)


def tiny_peft_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.2,
    )
    model = LlamaForCausalLM(config)
    lora = PeftLoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                          trainable_token_indices={"embed_tokens": [1, 2], "lm_head": [1, 2]})
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
    return {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(("stage", "method"), [(2, "prefix_lm"), (3, "mft")])
def test_loop_loss_falls_and_resume_is_exact(tmp_path: Path, stage: int, method: str) -> None:
    """Resuming from the step-3 checkpoint replays steps 4..8 exactly (same data, same MFT noise, same weights)."""
    config = experiment(method, zero_stage=stage, max_steps=8, grad_accum=2)
    rows = copy_rows(24)

    straight = Recorder(tmp_path / "straight")
    engine = train(tiny_peft_model(), rows, config, specials=SPECIALS, pad_id=PAD, report=straight)
    losses = [m.loss for m in straight.metrics]
    assert [m.step for m in straight.metrics] == list(range(1, 9))
    assert losses[-1] < 0.8 * losses[0], losses
    assert sorted(straight.checkpoints) == [3, 6, 8]
    assert (straight.checkpoints[8] / "adapter" / "adapter_model.safetensors").is_file()
    assert not (straight.checkpoints[6] / "adapter").exists()
    final = trainable_state(engine)

    resumed = Recorder(tmp_path / "resumed")
    engine = train(tiny_peft_model(), rows, config, specials=SPECIALS, pad_id=PAD, report=resumed,
                   resume_from=straight.checkpoints[3])
    assert [m.step for m in resumed.metrics] == [4, 5, 6, 7, 8]
    assert [m.loss for m in resumed.metrics] == pytest.approx(losses[3:], rel=1e-5)
    for name, value in trainable_state(engine).items():
        torch.testing.assert_close(value, final[name], rtol=1e-5, atol=1e-6)
