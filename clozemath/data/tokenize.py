"""Samples -> token ids; the special tokens (`<SEP>`, `<mask>`, `<M_k>`) and how they map onto a tokenizer."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from clozemath.data.samples import EOS, MASK, SEP, Sample, sentinel
from clozemath.errors import ClozeMathError

_RESERVED = re.compile(r"^<\|reserved_special_token_(\d+)\|>$")
_SENTINEL_INDEX = re.compile(r"<M_(\d+)>")


def special_names(num_sentinels: int) -> list[str]:
    return [SEP, MASK, *(sentinel(k) for k in range(num_sentinels))]


@dataclass(frozen=True)
class SpecialTokens:
    """Where each special token of the method lives in a tokenizer."""

    tokens: dict[str, str]
    """Our name (`<SEP>`) -> the tokenizer's token string (`<|reserved_special_token_0|>` or `<SEP>` itself)."""
    ids: dict[str, int]
    """Our name -> token id; also `<EOS>` -> the tokenizer's end-of-sequence id."""
    added: bool
    """True when new tokens were added: the model's embeddings must be resized."""
    ordinary_ids: tuple[int, ...]
    """The tokenizer's ordinary tokens (no special, reserved or added token, no padding row of the embedding matrix):
    what MFT's random-token noise draws from."""

    @property
    def trainable_ids(self) -> list[int]:
        """Rows of the embedding (and untied output) matrix that train along with LoRA."""
        return sorted(i for name, i in self.ids.items() if name != EOS)

    def name_of(self) -> dict[int, str]:
        return {i: name for name, i in self.ids.items()}


def reserved_tokens(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The tokenizer's unused reserved tokens (Llama 3: `<|reserved_special_token_k|>`), by k."""
    found = [(int(m.group(1)), token) for token in tokenizer.get_vocab() if (m := _RESERVED.match(token))]
    return [token for _, token in sorted(found)]


def install_special_tokens(
    tokenizer: PreTrainedTokenizerBase, num_sentinels: int, eos_token: str | None = None
) -> SpecialTokens:
    """Map `<SEP>`, `<mask>`, `<M_0>..<M_{n-1}>` onto reserved tokens where there are enough, else add them.

    Also fixes the end-of-sequence token when `eos_token` is given, and gives the tokenizer a pad token (the
    end-of-sequence token; padding is never attended nor trained on).
    """
    if eos_token is not None:
        if eos_token not in tokenizer.get_vocab():
            raise ClozeMathError(f"eos_token '{eos_token}' is not in the tokenizer's vocabulary")
        tokenizer.eos_token = eos_token
    if tokenizer.eos_token_id is None:
        raise ClozeMathError("the tokenizer has no end-of-sequence token: set model.eos_token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    names = special_names(num_sentinels)
    reserved = reserved_tokens(tokenizer)
    added = len(reserved) < len(names)
    if added:
        tokenizer.add_tokens(names, special_tokens=True)
        tokens = {name: name for name in names}
    else:
        tokens = dict(zip(names, reserved))
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in tokens.items()}
    ids[EOS] = tokenizer.eos_token_id
    return SpecialTokens(tokens=tokens, ids=ids, added=added, ordinary_ids=ordinary_token_ids(tokenizer))


def ordinary_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Ids of the tokenizer's ordinary tokens: all but its added and special ones (Llama 3's `<|...|>`, reserved
    tokens included); the embedding matrix's padding rows past `len(tokenizer)` are no tokens at all."""
    excluded = set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)
    return tuple(i for i in range(len(tokenizer)) if i not in excluded)


def token_offsets(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], list[tuple[int, int]]]:
    """A text -> the character offsets of its tokens, no special token added (random spans are drawn over them)."""
    if not tokenizer.is_fast:
        raise ClozeMathError(f"tokenizer {type(tokenizer).__name__} gives no character offsets (a fast one does)")

    def offsets(text: str) -> list[tuple[int, int]]:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [tuple(pair) for pair in encoded["offset_mapping"]]

    return offsets


# --------------------------------------------------------------------------------------------------------------
# Samples -> token ids -> batches

IGNORE_INDEX = -100
_NAME = re.compile(r"(<SEP>|<mask>|<EOS>|<M_\d+>)")
"""Our special-token names: a sample's text is split on them, the text between is tokenized on its own."""
_CUT = re.compile(r"\S\n(?=\S)|[.,;:?!](?= \S)")
"""Where a text piece is cut into chunks that are tokenized apart: after a newline between two lines of text, and
after a punctuation mark followed by a space and more text. A byte-level BPE tokenizer (Llama 3, GPT-2/SmolLM2) never
merges across these cuts, so the ids are those of the whole piece; the samples of one problem share most chunks,
which are then tokenized once."""
_CUT_PROBE = "Let $x=2$.\nThen x, y; z: w! So 1.5 . (a) b? Yes:\n\\[ y = 3 \\]\nDone"


def split_on_names(text: str) -> list[str]:
    """`a<SEP> b` -> ['a', '<SEP>', ' b']: text at even positions ('' between adjacent names), names at odd ones."""
    return _NAME.split(text)


def leading_special_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids the tokenizer puts before a text of its own accord (Llama 3: `<|begin_of_text|>`), else []."""
    bare = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return list(full[:start])
    return []


def _encode_texts(texts: list[str], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Token ids of plain texts, in one batched call (the Rust backend directly when there is one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _chunks(piece: str) -> list[str]:
    ends = [match.end() for match in _CUT.finditer(piece)]
    return [piece[start:end] for start, end in zip([0, *ends], [*ends, len(piece)])]


def _cuts_are_exact(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether cutting at `_CUT` keeps this tokenizer's ids (not so for one that marks a word start, SentencePiece)."""
    whole, *parts = _encode_texts([_CUT_PROBE, *_chunks(_CUT_PROBE)], tokenizer)
    return whole == list(chain.from_iterable(parts))


def _encode_pieces(pieces: Iterable[str], tokenizer: PreTrainedTokenizerBase) -> dict[str, list[int]]:
    """Token ids of each distinct text piece; each distinct chunk of them tokenized once, in one batched call."""
    cut = _chunks if _cuts_are_exact(tokenizer) else (lambda piece: [piece])
    chunks_of = {piece: cut(piece) for piece in pieces}
    chunks = list(dict.fromkeys(chain.from_iterable(chunks_of.values())))
    ids_of_chunk = dict(zip(chunks, _encode_texts(chunks, tokenizer)))
    return {piece: list(chain.from_iterable(map(ids_of_chunk.__getitem__, c))) for piece, c in chunks_of.items()}


def _require_installed(names: set[str], specials: SpecialTokens, samples: Sequence[Sample]) -> None:
    missing = sorted(names - specials.ids.keys(), key=lambda name: (len(name), name))
    if missing:
        culprit = next(s for s in samples if missing[0] in s.prefix + s.target)
        raise ClozeMathError(
            f"sample of {culprit.problem_id} uses {missing[0]}, which is not installed (install more sentinels)"
        )


def encode_samples(
    samples: Sequence[Sample], tokenizer: PreTrainedTokenizerBase, specials: SpecialTokens, max_length: int
) -> list[dict[str, Any] | None]:
    """`encode_sample` over many samples at once: each distinct chunk of text is tokenized once, in one call."""
    split = [(split_on_names(s.prefix), split_on_names(s.target)) for s in samples]
    names = {name for pair in split for part in pair for name in part[1::2]}
    _require_installed(names, specials, samples)
    ids_of = _encode_pieces({text for pair in split for part in pair for text in part[::2]}, tokenizer)
    ids_of.update((name, [specials.ids[name]]) for name in names)
    leading = leading_special_ids(tokenizer)
    encoded: list[dict[str, Any] | None] = []
    for prefix_parts, target_parts in split:
        prefix = leading + list(chain.from_iterable(map(ids_of.__getitem__, prefix_parts)))
        target = list(chain.from_iterable(map(ids_of.__getitem__, target_parts)))
        if len(prefix) + len(target) > max_length:
            encoded.append(None)
        else:
            labels = [IGNORE_INDEX] * len(prefix) + target
            encoded.append({"input_ids": prefix + target, "labels": labels, "prefix_len": len(prefix)})
    return encoded


def encode_sample(
    sample: Sample, tokenizer: PreTrainedTokenizerBase, specials: SpecialTokens, max_length: int
) -> dict[str, Any] | None:
    """`input_ids`, `labels` (-100 on the prefix) and `prefix_len` (leading BOS and `<SEP>` included), or None
    when the sample is longer than `max_length` (the caller counts those).

    Special tokens are written by name in the sample and mapped through `specials`; the tokenizer only ever sees
    the text between them.
    """
    return encode_samples([sample], tokenizer, specials, max_length)[0]


def collate(batch: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """One sample a row, right-padded to the longest (see `collate_packs`)."""
    return collate_packs([[row] for row in batch], pad_id, width=max(len(row["input_ids"]) for row in batch))


def collate_packs(packs: Sequence[Sequence[dict[str, Any]]], pad_id: int, width: int) -> dict[str, torch.Tensor]:
    """Rows of `width` tokens, each holding the samples of one pack one after the other, then right padding.

    `input_ids`; `labels` (-100 on prefixes and padding); `attention_mask` (0 on padding, else the number of the sample
    in its row: 1, 2, ...; the documents of `clozemath.model.attention`); `prefix_mask` (True on each sample's prefix).
    A sample's first token never has a label, so no sample is trained to predict across the boundary before it.
    """
    rows = [_packed_row(pack, pad_id, width) for pack in packs]
    names = ("input_ids", "labels", "attention_mask", "prefix_mask")
    return {name: torch.from_numpy(np.stack([row[k] for row in rows]) if rows else np.zeros((0, width), np.int64))
            .to(torch.bool if name == "prefix_mask" else torch.long) for k, name in enumerate(names)}


def _packed_row(pack: Sequence[dict[str, Any]], pad_id: int, width: int) -> tuple[np.ndarray, ...]:
    """One row of `collate_packs`, built in numpy from the samples' lengths (a tensor write per sample cost ~50 ms
    for a 16,384-token row of ~100 samples on a slow host; this takes ~2 ms)."""
    lengths = np.fromiter((len(item["input_ids"]) for item in pack), dtype=np.int64, count=len(pack))
    prefix_lens = np.fromiter((int(item["prefix_len"]) for item in pack), dtype=np.int64, count=len(pack))
    total = int(lengths.sum())
    if total > width:
        raise ClozeMathError(f"a pack of {total} tokens exceeds its {width}")
    starts = np.cumsum(lengths) - lengths
    input_ids = np.full(width, pad_id, dtype=np.int64)
    labels = np.full(width, IGNORE_INDEX, dtype=np.int64)
    documents = np.zeros(width, dtype=np.int64)
    prefix = np.zeros(width, dtype=bool)
    input_ids[:total] = np.fromiter(chain.from_iterable(item["input_ids"] for item in pack), np.int64, total)
    labels[:total] = np.fromiter(chain.from_iterable(item["labels"] for item in pack), np.int64, total)
    labels[starts[lengths > 0]] = IGNORE_INDEX
    documents[:total] = np.repeat(np.arange(1, len(pack) + 1), lengths)
    position_in_sample = np.arange(total) - np.repeat(starts, lengths)
    prefix[:total] = position_in_sample < np.repeat(prefix_lens, lengths)
    return input_ids, labels, documents, prefix


def num_sentinels_needed(samples: Iterable[Sample]) -> int:
    """How many sentinels `<M_0>..<M_{n-1}>` the samples use (0 when none masks anything)."""
    return max((int(k) + 1 for s in samples for k in _SENTINEL_INDEX.findall(s.prefix)), default=0)


def decode_with_names(ids: Iterable[int], tokenizer: PreTrainedTokenizerBase, specials: SpecialTokens) -> str:
    """Token ids as text, our special tokens written by name (`<SEP>`, `<M_0>`, `<EOS>`, ...)."""
    names = specials.name_of()
    parts: list[str] = []
    run: list[int] = []
    for token_id in [*ids, None]:
        if token_id is not None and token_id not in names:
            run.append(int(token_id))
            continue
        if run:
            parts.append(tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False))
            run = []
        if token_id is not None:
            parts.append(names[token_id])
    return "".join(parts)
