"""Reading YAML a user hands us (the run spec, run.yaml, `--set` lists) with limits, so a hostile or
careless file ends in one line and exit 2 instead of a traceback or minutes of work.

- size: MAX_BYTES per file;
- text: UTF-8 only (a UTF-16 or Latin-1 file is refused, not guessed at);
- nesting: MAX_DEPTH levels (deeper input would exhaust the composer's recursion);
- aliases: the document, with every alias expanded, may have at most MAX_NODES nodes (a small file
  whose anchor is referenced many times would otherwise validate and render as hundreds of MB), and
  at most MAX_CHARS characters of scalars (one long string referenced many times);
- keys: a key given twice in one mapping is refused (YAML readers disagree on which one wins);
- numbers: YAML 1.1's base-60 integers are plain strings here (`48:00:00` stays a time, not 172800),
  and `1e-3` is a float as in YAML 1.2.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from dskit.errors import SpecError
from dskit.io import bounded_read

MAX_BYTES = 1 << 20
MAX_DEPTH = 64
MAX_NODES = 100_000
MAX_CHARS = 4 << 20


class _Limit(Exception):
    """Raised inside the loader; turned into a SpecError naming the file by the caller."""


class _Loader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Limit(f"nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` then explicit keys: overriding is what merge is for
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the base constructor reports it
                    continue
                if duplicate:
                    line = key_node.start_mark.line + 1
                    raise _Limit(f"duplicate key {key!r} (line {line}); each key may appear once")
        return super().construct_mapping(node, deep=deep)

    def compose_document(self) -> Node:
        node = super().compose_document()
        nodes, chars = expanded_size(node)
        if nodes > MAX_NODES:
            raise _Limit(f"expands to more than {MAX_NODES} values through aliases (&anchor / *alias)")
        if chars > MAX_CHARS:
            raise _Limit(
                f"expands to more than {MAX_CHARS >> 20} MiB of text through aliases (&anchor / *alias)"
            )
        return node


def expanded_size(node: Node, memo: dict[int, tuple[int, int] | None] | None = None) -> tuple[int, int]:
    """(nodes, characters of scalars) in `node` with every alias expanded (shared subtrees counted once
    per reference). Stops adding once either passes its limit."""
    memo = {} if memo is None else memo
    key = id(node)
    if key in memo:
        if memo[key] is None:
            raise _Limit("an alias refers to the node that contains it")
        return memo[key]  # type: ignore[return-value]
    memo[key] = None
    size, chars = 1, 0
    if isinstance(node, (SequenceNode, MappingNode)):
        children = node.value if isinstance(node, SequenceNode) else [c for kv in node.value for c in kv]
        for child in children:
            n, c = expanded_size(child, memo)
            size, chars = size + n, chars + c
            if size > MAX_NODES or chars > MAX_CHARS:
                break
    else:
        chars = len(node.value)
    memo[key] = (size, chars)
    return size, chars


_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _INT,
    re.compile(r"[-+]?(?:0b[01_]+|0x[0-9a-fA-F_]+|0[0-7_]+|0|[1-9][0-9_]*)\Z"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))\Z"
    ),
    list("-+0123456789."),
)


def loads(text: str, where: str) -> Any:
    """Parse one YAML document; any problem is a SpecError naming `where`."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except _Limit as e:
        raise SpecError(where, str(e)) from None
    except yaml.YAMLError as e:
        raise SpecError(where, f"not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise SpecError(where, "nested too deeply") from None
    except (ValueError, OverflowError) as e:  # e.g. an integer beyond Python's 4300-digit limit
        raise SpecError(where, f"not a usable YAML value: {e}") from None


def read_text(path: str | Path, what: str = "file") -> str:
    """A user's text file: at most MAX_BYTES (dskit.io.bounded_read), UTF-8 (a leading BOM is dropped)."""
    p = Path(path)
    try:
        if not p.is_file():
            raise SpecError(str(path), f"{what} not found" if not p.exists() else f"{what} is not a file")
        data = bounded_read.read_bytes(p, limit=MAX_BYTES, what=f"a {what}")
    except bounded_read.TooLarge as e:
        raise SpecError(str(path), f"{what} {e.reason}") from None
    except OSError as e:
        raise SpecError(str(path), f"cannot read the {what}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SpecError(str(path), f"{what} is not UTF-8 text (bad byte at offset {e.start})") from None


def load_file(path: str | Path, what: str = "file") -> Any:
    return loads(read_text(path, what), str(path))
