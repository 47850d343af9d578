"""The decodings by name, as configs (`eval.decodings`), predictions files and metric keys spell them.

Light on purpose (no torch): a config's names are checked against `decoding_names()` before anything heavy is imported;
a built-in decoding's module is imported when it is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from clozemath.registry import Registry

if TYPE_CHECKING:
    from clozemath.eval.decoding.job import Decoding

DECODINGS: Registry[Decoding] = Registry("decoding", [
    ("greedy", "clozemath.eval.decoding.rows:GREEDY"),
    ("beam", "clozemath.eval.decoding.beam:BEAM"),
    ("cot", "clozemath.eval.decoding.cot:COT"),
], context="decode: ")
"""Each decoding (a `Decoding`) by name: the built-in ones as `module:object`, in the order reports list them."""
register = DECODINGS.register
"""`register(name, decoding)`: make a decoding known by its name (registering a name again replaces it)."""
decoding_names = DECODINGS.names
get_decoding = DECODINGS.__getitem__
