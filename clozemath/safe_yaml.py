"""YAML documents read as plain data within bounds: the size of a file, the values once aliases are expanded, the
depth of nesting. Configs, overrides and the throughput table are read through here; a mistake or an excess is a
one-line `ClozeMathError` naming the file (and line). A config is written back as YAML (`dump_yaml`) here too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from clozemath.errors import ClozeMathError

MAX_CONFIG_BYTES = 1 << 20
"""The largest config file read (1 MiB): the project's own are under 5 KiB, the paper's grid included."""
MAX_CONFIG_VALUES = 100_000
"""The most values (mappings, lists, scalars) a YAML document may hold once its aliases are expanded: a `&anchor`
used many times counts each time, so that a few lines of nested aliases ("billion laughs") cannot grow into
gigabytes when the config is validated, copied or logged. The paper's grid holds 256."""
MAX_CONFIG_DEPTH = 64
"""The deepest nesting of mappings and lists in a YAML document (the project's go 8 deep)."""


def _expanded_size(root: yaml.Node) -> tuple[int, int] | None:
    """How many values the document holds with every alias expanded, and how deep it nests; None when an alias holds
    itself. Walks the node graph once (each shared node sized once), without recursion."""
    sizes: dict[int, tuple[int, int]] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        children = [] if isinstance(node, yaml.ScalarNode) else (
            [item for pair in node.value for item in pair] if isinstance(node, yaml.MappingNode) else node.value
        )
        if children_done:
            open_nodes.discard(id(node))
            counted = [sizes[id(child)] for child in children]
            size, depth = sum(size for size, _ in counted), max((depth for _, depth in counted), default=0)
            sizes[id(node)] = (1 + size, 1 + depth)
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            return None
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


class NotYaml(ClozeMathError):
    """Text that does not parse as YAML."""


def parse_yaml(text: str, where: str) -> Any:
    """YAML `text` as plain data, within `MAX_CONFIG_VALUES` (aliases expanded) and `MAX_CONFIG_DEPTH`; a mistake
    or an excess is a one-line error naming `where`."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded = _expanded_size(node)
        if expanded is None:
            raise ClozeMathError(f"{where}: an alias (*name) inside its own anchor (&name): the YAML never ends")
        size, depth = expanded
        if size > MAX_CONFIG_VALUES:
            raise ClozeMathError(
                f"{where}: the YAML holds more than {MAX_CONFIG_VALUES:,} values once its aliases (*name) are expanded"
            )
        if depth > MAX_CONFIG_DEPTH:
            raise ClozeMathError(f"{where}: the YAML nests deeper than {MAX_CONFIG_DEPTH} levels")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise NotYaml(f"{where}{line}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ClozeMathError(f"{where}: the YAML nests deeper than {MAX_CONFIG_DEPTH} levels") from None
    finally:
        loader.dispose()


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ClozeMathError(f"{path}: no such config file")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ClozeMathError(f"{path}: {size:,} bytes, more than a config may hold ({MAX_CONFIG_BYTES:,})")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ClozeMathError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x})") from None
    raw = parse_yaml(text, str(path))
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ClozeMathError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    return raw


def dump_yaml(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
