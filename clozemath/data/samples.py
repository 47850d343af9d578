"""A training sample as text: what the objectives make and the tokenizer encodes, special tokens written by name.

The names live here, apart from the tokenizer (`clozemath.data.tokenize` maps them onto token ids), so that the
objectives, and a config's check of their names, load without torch or transformers."""

from __future__ import annotations

from dataclasses import asdict, dataclass

SEP = "<SEP>"
MASK = "<mask>"
EOS = "<EOS>"


def sentinel(k: int) -> str:
    return f"<M_{k}>"


@dataclass(frozen=True)
class Sample:
    """Prefix and target as text, special tokens written by name: `<SEP>`, `<M_0>`, `<mask>`, `<EOS>`."""

    problem_id: str
    kind: str
    """The name of the objective that made it (`clozemath.data.objectives`)."""
    prefix: str
    target: str

    def to_dict(self) -> dict[str, str]:
        """A row for Ray Data (`Sample(**row)` reads it back)."""
        return asdict(self)
