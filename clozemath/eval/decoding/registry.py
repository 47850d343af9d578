"""The decodings by name, as configs (`eval.decodings`), predictions files and metric keys spell them.

Light on purpose (no torch): a config's names are checked against `decoding_names()` before anything heavy is imported;
a built-in decoding's module is imported when it is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from clozemath.errors import ClozeMathError

if TYPE_CHECKING:
    from clozemath.eval.decoding.job import Decoding

_BUILT_IN = {
    "greedy": "clozemath.eval.decoding.rows:GREEDY",
    "beam": "clozemath.eval.decoding.beam:BEAM",
    "cot": "clozemath.eval.decoding.cot:COT",
}
"""Name -> `module:object` of each built-in decoding (a `Decoding`), in the order reports list them."""
_DECODINGS: dict[str, Decoding | str] = dict(_BUILT_IN)


def register(name: str, decoding: Decoding) -> Decoding:
    """Make a decoding known by its name (registering a name again replaces it)."""
    _DECODINGS[name] = decoding
    return decoding


def decoding_names() -> tuple[str, ...]:
    """Every decoding's name: the built-in ones first, in their order, then those registered."""
    return tuple(_DECODINGS)


def get_decoding(name: str) -> Decoding:
    if name not in _DECODINGS:
        raise ClozeMathError(f"decode: unknown decoding '{name}' (known: {', '.join(_DECODINGS)})")
    found = _DECODINGS[name]
    if isinstance(found, str):
        module, _, attribute = found.partition(":")
        found = _DECODINGS[name] = getattr(importlib.import_module(module), attribute)
    return found
