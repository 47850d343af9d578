"""Samples -> token ids; the special tokens (`<SEP>`, `<mask>`, `<M_k>`) and how they map onto a tokenizer."""

from __future__ import annotations

import re
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from clozemath.errors import ClozeMathError

SEP = "<SEP>"
MASK = "<mask>"
EOS = "<EOS>"
_RESERVED = re.compile(r"^<\|reserved_special_token_(\d+)\|>$")


def sentinel(k: int) -> str:
    return f"<M_{k}>"


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
    return SpecialTokens(tokens=tokens, ids=ids, added=added)
