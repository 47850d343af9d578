"""A training sample as text: what the objectives make and the tokenizer encodes."""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
