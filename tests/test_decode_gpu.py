"""On a GPU: the graph engine (CUDA graphs replayed over a static cache) gives the tokens of the same engine stepped
eagerly (the same kernels), on a real model, and its continuous batching (rows of ended prompts refilled) the tokens
of batches that hold every prompt. `CLOZEMATH_GPU_MODEL`: a model YAML or a name in configs/models (default
smollm2-135m). Give it three minutes on a GPU (most of it loading and dequantizing the GGUF weights)."""

from __future__ import annotations

import math
import os
from functools import partial
from pathlib import Path

import pytest
import torch

from clozemath.config import DataConfig, ModelConfig
from clozemath.data.sources import load_problems
from clozemath.eval.decoding import DecodeSettings, DecodeStats, decode
from clozemath.eval.evaluate import Prompting, build_prompts
from clozemath.safe_yaml import read_yaml
from clozemath.tasks import answer_span, get_task

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[1]


def gpu_model(dtype: str) -> ModelConfig:
    """`CLOZEMATH_GPU_MODEL`'s config (a YAML file or a name in configs/models) in `dtype`."""
    spec = os.environ.get("CLOZEMATH_GPU_MODEL", "smollm2-135m")
    path = Path(spec) if spec.endswith((".yaml", ".yml")) else ROOT / "configs" / "models" / f"{spec}.yaml"
    return ModelConfig.model_validate(read_yaml(path)).model_copy(update={"dtype": dtype})


def load(dtype: str):
    """The model as transformers makes it (no speed levers): the engines' tests compare engines, and the levers' tests
    apply each lever to a copy of it."""
    from clozemath.model.load import load_model
    from clozemath.model.speed import PLAIN

    return load_model(gpu_model(dtype), 0, torch.device("cuda"), training=False, levers=PLAIN)


@pytest.fixture(scope="module")
def loaded():
    return load("bfloat16")


@pytest.fixture(scope="module")
def loaded32():
    return load("float32")


def prompts_for(loaded, limit: int) -> list[list[int]]:
    """The fine-tuned format's prompts of the first `limit` GSM8K test problems."""
    problems = load_problems("gsm8k", "test", limit=limit)
    prompting = Prompting(few_shot=False, attention="causal", template=DataConfig().prompt_template)
    return [prompt.ids for prompt in build_prompts(problems, loaded, prompting)]


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    return prompts_for(loaded, 32)


def tokens(generations) -> list[list[list[int]]]:
    return [[branch.token_ids for branch in g.branches or [g]] for g in generations]


@pytest.mark.parametrize(
    ("scheme", "attention"), [("greedy", "causal"), ("greedy", "bidirectional"), ("beam", "causal"), ("cot", "causal")]
)
def test_graphs_give_the_tokens_of_the_same_steps_run_eagerly(loaded, prompts, scheme, attention):
    def run(engine: str, stats: DecodeStats | None = None):
        return decode(loaded.model, loaded.tokenizer, prompts, scheme, DecodeSettings(
            max_new_tokens=128, prompt_attention=attention, batch_size=16, num_beams=5, cot_k=9,
            answer_span=partial(answer_span, "gsm8k"), normalize_answer=get_task("gsm8k").answer_key, engine=engine,
        ), stats=stats)

    stats = DecodeStats()
    graphs, static = run("graphs", stats), run("static")
    assert tokens(graphs) == tokens(static)
    assert [g.finish_reason for g in graphs] == [g.finish_reason for g in static]
    if attention == "causal":  # SmolLM2 was not trained with bidirectional prompts: there it may never stop
        # a real model ends rows at different steps (at EOS or a stop string; Qwen's CoT branches, 2026-12-02: by stops)
        assert any(b.finish_reason != "length" for g in graphs for b in g.branches or [g])
    assert stats.refills == (0 if scheme == "beam" else len(prompts) - 16)  # beam search keeps its batches


@pytest.mark.parametrize("scheme", ["greedy", "cot"])
def test_refilled_rows_give_the_tokens_of_a_batch_of_all_prompts(loaded32, prompts, scheme):
    """In float32 (no bfloat16 rounding that another batch's shapes could tip): 8 prompts' rows, refilled as prompts
    end, give every prompt the tokens it gets in one batch of all 32."""
    def run(batch_size: int, stats: DecodeStats):
        return decode(loaded32.model, loaded32.tokenizer, prompts, scheme, DecodeSettings(
            max_new_tokens=128, batch_size=batch_size, cot_k=9, answer_span=partial(answer_span, "gsm8k"),
            normalize_answer=get_task("gsm8k").answer_key, engine="graphs",
        ), stats=stats)

    refilling, whole = DecodeStats(), DecodeStats()
    refilled, one_batch = run(8, refilling), run(len(prompts), whole)
    assert tokens(refilled) == tokens(one_batch)
    assert (refilling.refills, whole.refills) == (len(prompts) - 8, 0)


def test_beams_sharing_their_prompt_on_graphs_give_the_eager_engines_beams_in_float32(loaded32, prompts):
    """Beam-5 on CUDA graphs over a cache entry a prompt (`SharedPromptBatch`: one copy of the prompt, the beams'
    lineages as bits) against the eager engine (a cache a row, reordered by copying), in float32 on the real model,
    160 new tokens (into the areas' second block): at least 90% of the prompts get the same tokens (a beam's near-tie
    between two kernels' roundings is not checked one by one), and their scores agree."""
    def run(engine: str):
        return decode(loaded32.model, loaded32.tokenizer, prompts, "beam", DecodeSettings(
            max_new_tokens=160, batch_size=16, num_beams=5, engine=engine,
        ))

    shared, eager = run("graphs"), run("eager")
    same = [s.token_ids == e.token_ids for s, e in zip(shared, eager)]
    assert sum(same) >= 0.9 * len(prompts), f"{sum(same)} of {len(prompts)} prompts with the eager engine's beams"
    for s, e, is_same in zip(shared, eager, same):
        if is_same:
            assert s.score == pytest.approx(e.score, abs=1e-3)


def test_a_model_in_training_evaluated_on_graphs_decodes_its_static_steps_tokens_and_trains_on_as_it_was(
    prompts, tmp_path, monkeypatch
):
    """Evaluation during training on a CUDA worker under ZeRO-2, which decodes on CUDA graphs
    (`during_training_engine`). The model in training (float32; LoRA and the special-token rows, `<SEP>` ending
    every prompt, moved off their start) trains as `clozemath.train.loop.train` trains it in a worker: FlexAttention,
    its decoder layers compiled, on a DeepSpeed ZeRO-2 engine. After its first step, readied for the graph engine
    (`decoding_in_training`: the rows merged, the compiled layers set aside), it gives greedy the tokens of its own
    static steps uncaptured (the same kernels), and those of the static steps with the rows written over the
    matrices at every forward instead of merged, as training writes them. (Today's path ran the same steps with all
    compiled code eager, FlexAttention's reference code among it: another rounding in float32, which
    tests/test_during_training.py compares on the CPU.) After it, every parameter and buffer, requires_grad, the
    trained tensors themselves and the engine's optimizer state are as before to the bit, train mode and
    FlexAttention are back, and the second step trains."""
    import clozemath.train.loop as loop
    from clozemath.eval.during_training import during_training_engine
    from clozemath.model.load import load_model
    from clozemath.train.compilation import decoder_layers_uncompiled
    from clozemath.train.inference import decoding_in_training
    from tests.test_train import copy_rows, experiment

    cfg = gpu_model("float32")
    training = load_model(cfg, 0, torch.device("cuda"), training=True, seed=0)
    model = training.model
    assert model.config._attn_implementation == "flex_attention"
    generator = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator, device="cuda"))
    assert during_training_engine(2, "cuda") == "graphs"
    engines: list = []
    build_engine = loop.build_engine
    monkeypatch.setattr(loop, "build_engine", lambda *args, **kwargs: engines.append(build_engine(*args, **kwargs))
                        or engines[-1])  # the worker's engine, whose optimizer state is checked

    def greedy(engine: str) -> list[list[list[int]]]:
        return tokens(decode(model, training.tokenizer, prompts[:16], "greedy", DecodeSettings(
            max_new_tokens=32, batch_size=8, engine=engine, eos_token_ids=training.tokenizer.eos_token_id,
        )))

    def state() -> list[tuple[str, torch.Tensor, bool, int | None]]:
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
        optimizer = [("optimizer", tensor) for tensor in _tensors(engines[0].optimizer.state_dict())]
        return [(name, tensor.detach().clone(), tensor.requires_grad,
                 tensor.data_ptr() if tensor.requires_grad else None) for name, tensor in [*named, *optimizer]]

    seen: dict[str, list] = {"steps": []}

    def report(metrics, checkpoint) -> None:
        seen["steps"].append((metrics.step, metrics.loss))
        if metrics.step != 1:
            return
        before = state()
        with decoding_in_training(model, "graphs"):
            seen["graphs"], seen["static"] = greedy("graphs"), greedy("static")
        seen["back"] = (model.training, model.config._attn_implementation)
        after = state()
        seen["unchanged"] = len(after) == len(before) and all(
            (name, requires_grad, pointer) == (name_after, requires_grad_after, pointer_after)
            and torch.equal(tensor, tensor_after)
            for (name, tensor, requires_grad, pointer), (name_after, tensor_after, requires_grad_after, pointer_after)
            in zip(before, after))
        model.eval()
        model.set_attn_implementation("sdpa")
        with decoder_layers_uncompiled(model):  # the rows written at every forward
            seen["rows_each_forward"] = greedy("static")
        model.set_attn_implementation("flex_attention")
        model.train()

    config = experiment("prefix_lm", zero_stage=2, max_steps=2, checkpoint_every=2, pack_tokens=256, compile=True)
    loop.train(model, copy_rows(64), config, specials=training.specials, pad_id=training.tokenizer.pad_token_id,
               report=report, scratch_dir=tmp_path)
    assert seen["graphs"] == seen["static"] == seen["rows_each_forward"]
    assert seen["unchanged"] and seen["back"] == (True, "flex_attention")
    assert [step for step, _ in seen["steps"]] == [1, 2] and all(math.isfinite(loss) for _, loss in seen["steps"])


def _tensors(value) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples (an optimizer's state dict)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


def test_beam_batches_on_graphs_are_freed_without_the_cycle_collector(loaded, prompts):
    """The issue-25 lease's final evaluations ran out of a fifth of an H100 in beam search: every captured batch
    lived on (a reference cycle through its graph's function) until the cycle collector ran, and each batch's capture
    on a new stream left PyTorch a cuBLAS workspace (the 2026-11-27 lease: 256 MiB more after these 8 batches). With
    the collector off, the device memory after decoding is what it was before."""
    import gc

    settings = DecodeSettings(num_beams=5, max_new_tokens=64, batch_size=4, engine="graphs",
                              eos_token_ids=loaded.tokenizer.eos_token_id)
    decode(loaded.model, loaded.tokenizer, prompts[:4], "beam", settings)  # kernels and the allocator warmed
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gc.disable()
    try:
        decode(loaded.model, loaded.tokenizer, prompts, "beam", settings)  # 8 batches of 4 prompts
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
    finally:
        gc.enable()


def test_the_model_a_worker_trained_decodes_the_tokens_of_the_actors_model_in_float32(tmp_path):
    """Evaluation in the training worker (`eval.in_worker`): the model trained on the card (flex attention, LoRA and
    the special-token rows moved off their start as steps would, the adapter saved) made the evaluated model in
    place, against the base model loaded afresh with the saved adapter merged (the evaluation actor's): the same
    weights to the bit, and the auto engine (CUDA graphs) gives the same tokens, greedy, in float32."""
    from clozemath.model.load import load_for_inference, load_model, save_adapter, trained_for_inference

    cfg = gpu_model("float32")
    trained = load_model(cfg, 0, torch.device("cuda"), training=True, seed=0)
    generator = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for parameter in trained.model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator, device="cuda"))
    adapter = save_adapter(trained.model, tmp_path / "adapter", trained.specials)
    worker = trained_for_inference(cfg, trained, adapter)
    actor = load_for_inference(cfg, adapter, torch.device("cuda"))
    theirs = actor.model.state_dict()
    assert all(torch.equal(tensor, theirs[name]) for name, tensor in worker.model.state_dict().items())

    prompts = prompts_for(actor, 16)  # not the module's fixture: it loads a bfloat16 model first (109 s on Qwen)

    def run(loaded):
        return decode(loaded.model, loaded.tokenizer, prompts, "greedy", DecodeSettings(
            max_new_tokens=32, batch_size=8, engine="auto", eos_token_ids=loaded.tokenizer.eos_token_id,
        ))

    assert tokens(run(worker)) == tokens(run(actor))


# --------------------------------------------------------------------------------------------------------------
# The speed levers (clozemath.model.speed): fused products and liger-kernel's kernels, against the plain model

LEVERS = ["fused", "liger", "both"]
NEAR_TIE = 1e-3
"""A float32 logit gap this small between the plain model's choice and the token a lever's model chose may be tipped:
liger's Triton kernels (RMSNorm's reduction, the SwiGLU and rotary arithmetic) and cuBLAS's kernels for the wider
fused products add and round in another order than transformers' torch operations (differences ~1e-6 of a logit);
after a tipped token a row's continuation is another one. So the tokens are held equal up to such a tie."""


def lever_model(loaded32, lever: str):
    import copy

    from clozemath.model.speed import SpeedLevers, apply_levers

    levers = SpeedLevers(fused_projections=lever in ("fused", "both"), liger_kernels=lever in ("liger", "both"))
    return apply_levers(copy.deepcopy(loaded32.model), levers)


def test_a_model_loaded_for_inference_on_the_gpu_gets_ligers_kernels(loaded32):
    """What clozemath gives a model it loads for inference on a GPU with liger-kernel (`inference_levers`): liger's
    norm, rotary and SwiGLU forwards on every layer of this instance, no fused products."""
    import copy

    pytest.importorskip("liger_kernel")
    from clozemath.model.speed import apply_levers

    model = apply_levers(copy.deepcopy(loaded32.model))
    layers = model.model.layers
    assert all("forward" in vars(layer.self_attn) and "forward" in vars(layer.mlp) for layer in layers)
    assert all(hasattr(layer.self_attn, "q_proj") for layer in layers)  # not fused
    assert not any("forward" in vars(layer.self_attn) for layer in loaded32.model.model.layers)  # the copy only


@pytest.fixture(scope="module", params=LEVERS)
def levered(request, loaded32):
    if request.param != "fused":
        pytest.importorskip("liger_kernel")
    return request.param, lever_model(loaded32, request.param)


def test_levers_give_the_plain_models_logits_in_float32(loaded32, levered, prompts):
    """A prompt pass over 8 prompts (left-padded) through both models: the same logits within float32 rounding; liger's
    modules are in place (not a no-op)."""
    lever, model = levered
    if lever != "fused":
        layer = model.model.layers[0]
        assert layer.input_layernorm._get_name() == "LigerRMSNorm" and layer.mlp._get_name() == "LigerSwiGLUMLP"
        assert layer.self_attn.forward.__func__.__globals__["apply_rotary_pos_emb"].__module__.startswith("liger")
    pad = loaded32.tokenizer.pad_token_id
    rows = prompts[:8]
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device="cuda")
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device="cuda")
    with torch.inference_mode():
        expected = loaded32.model(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("scheme", "attention"), [("greedy", "causal"), ("greedy", "bidirectional"), ("beam", "causal"), ("cot", "causal")]
)
def test_levers_decode_the_plain_models_tokens_in_float32_up_to_near_ties(loaded32, levered, prompts, scheme,
                                                                            attention):
    """The graph engine (its CUDA graphs captured over the levers' modules) on 32 prompts, 64 new tokens. Greedy
    causal: every prompt's tokens are the plain model's, or first differ where the plain model's two candidates are
    within `NEAR_TIE` (checked on its own logits there). Every scheme: at least 90% of the prompts identical (a beam's
    or branch's near-tie is not checked one by one)."""
    lever, model = levered

    def run(each):
        return decode(each, loaded32.tokenizer, prompts, scheme, DecodeSettings(
            max_new_tokens=64, prompt_attention=attention, batch_size=16, num_beams=5, cot_k=9,
            answer_span=partial(answer_span, "gsm8k"), normalize_answer=get_task("gsm8k").answer_key, engine="graphs",
        ))

    plain, ours = tokens(run(loaded32.model)), tokens(run(model))
    same = sum(p == o for p, o in zip(plain, ours))
    assert same >= 0.9 * len(prompts), f"{lever}: {same} of {len(prompts)} prompts with the plain model's tokens"
    if (scheme, attention) != ("greedy", "causal"):
        return
    for prompt, (theirs,), (mine,) in zip(prompts, plain, ours):
        at = next((i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b), None)
        if at is None:
            assert len(theirs) == len(mine)
            continue
        with torch.inference_mode():
            logits = loaded32.model(input_ids=torch.tensor([prompt + theirs[:at]], device="cuda")).logits[0, -1]
        gap = (logits[theirs[at]] - logits[mine[at]]).item()  # ~0 either way: this pass is not the batch's
        assert abs(gap) < NEAR_TIE, f"{lever}: a prompt's tokens differ at step {at} where the gap is {gap:.2e}"


@pytest.mark.parametrize(("copies", "reorder"), [(9, False), (5, True)])
@torch.inference_mode()
def test_shared_prompt_attention_on_the_gpu_is_dense_attention_under_its_mask(copies, reorder):
    """The compiled FlexAttention kernel over `SharedPromptBatch`'s cache (prompts of one and two blocks, each with
    `copies` rows: CoT branches keeping their own lineage, or beams reordered at random) reads the blocks its mask
    needs: its attention is dense softmax attention under the same mask, in float32, as the rows cross from their
    areas' first block into the second. A tiny random Llama (12 query heads over 2 key-value heads, as Qwen's)."""
    from torch.nn.attention.flex_attention import create_mask
    from transformers import LlamaConfig, LlamaForCausalLM

    from clozemath.eval.decoding.eager import prefill
    from clozemath.eval.decoding.static import SharedPromptBatch, _flex_decode_attention

    torch.manual_seed(0)
    heads, kv_heads, dim, vocab = 12, 2, 64, 512
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=heads * dim, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim,
    )).cuda().eval()
    prompts = [list(range(1, n)) for n in (200, 90, 10, 140)]
    passed, _ = prefill(model, prompts, 0, "causal")
    rows = len(prompts) * copies
    batch = SharedPromptBatch(model, rows, copies, 256, 256, passed.cache, graphs=False, vocab=vocab, margins=False)
    batch.place(range(rows), passed, [row // copies for row in range(rows)],
                [len(prompts[row // copies]) for row in range(rows)])
    for step in range(140):
        batch.step(torch.randint(vocab, (rows,), device="cuda"))
        if step in (0, 126, 127, 128, 139):
            keys, values = batch.cache.layers[0].keys, batch.cache.layers[0].values
            query = torch.randn(rows, heads, 1, dim, device="cuda")
            got, _ = _flex_decode_attention(None, query, keys, values, batch._mask, scaling=dim**-0.5)
            group = heads // kv_heads
            grouped = query.reshape(len(prompts), copies, kv_heads, group, dim).transpose(1, 2)
            grouped = grouped.reshape(len(prompts), kv_heads, copies * group, dim)
            allowed = create_mask(batch._mask.mask_mod, len(prompts), 1, copies * group, batch.slots, device="cuda")
            scores = (grouped @ keys.transpose(-1, -2) * dim**-0.5).masked_fill(~allowed, -torch.inf)
            expected = (scores.softmax(-1) @ values).view(len(prompts), kv_heads, copies, group, dim).transpose(1, 2)
            torch.testing.assert_close(got, expected.reshape(rows, 1, heads, dim), rtol=1e-4, atol=1e-4)
        if reorder:
            parents = torch.randint(copies, (len(prompts), copies), device="cuda")
            batch.take((torch.arange(len(prompts), device="cuda")[:, None] * copies + parents).flatten())
