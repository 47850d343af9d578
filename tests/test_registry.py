"""The one registry every named thing uses (training sets, objectives, tasks, decodings): order, lazy entries, the
one-line error, registering."""

from __future__ import annotations

import json

import pytest

from clozemath.errors import ClozeMathError
from clozemath.registry import Registry


def test_an_entry_named_by_module_and_attribute_is_imported_at_its_first_lookup() -> None:
    things = Registry("thing", [("dumps", "json:dumps"), ("loads", json.loads)])
    assert things["dumps"] is json.dumps and things["loads"] is json.loads
    assert things.entries() == [json.dumps, json.loads]


def test_an_unknown_name_is_one_line_that_lists_the_known_in_their_order() -> None:
    things = Registry("thing", [("b", 1), ("a", 2)], context="look: ")
    with pytest.raises(ClozeMathError) as raised:
        things["c"]
    assert str(raised.value) == "look: unknown thing 'c' (known: b, a)"


def test_registered_names_come_after_the_built_in_ones_and_replace_a_name_in_place() -> None:
    things = Registry("thing", [("b", 1), ("a", 2)])
    assert things.register("z", 3) == 3
    things.register("b", 4)
    assert things.names() == ("b", "a", "z") and things["b"] == 4
    assert "z" in things and "y" not in things and list(things) == ["b", "a", "z"]
