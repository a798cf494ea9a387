"""The one rule for reading a JSON or YAML file, or a safetensors header, that dskit did not just write
itself (a run directory, a checkpoint, a model directory, a calibration): its size is checked against a
limit before a byte of it is parsed, and the parsed value's nesting against MAX_DEPTH, so a damaged
multi-GB `dskit.json` or a hostile header is one line naming the file and the limit, never a
MemoryError or a RecursionError traceback.

Every such reader states its limit beside it (a constant named for its file) and reads through
`read_bytes` / `read_json` / `iter_jsonl`; a limit crossed raises `TooLarge`, a ValueError, so
readers that already turn a damaged file into their one line (a skipped checkpoint, a SpecError naming
the field) keep doing so, with the limit in the message. tests/spec/test_bounded_reads.py walks the
package for parsers called anywhere else.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: How deep a JSON document may nest: every file dskit reads is a few levels deep (a safetensors header
#: three, a config.json four); YAML has its own limit (dskit/spec/yamlsafe.py MAX_DEPTH).
MAX_DEPTH = 32

KiB, MiB = 1 << 10, 1 << 20


class TooLarge(ValueError):
    """A file (or one line of it) over its limit, or nested deeper than MAX_DEPTH. str(): one line naming
    the file and the limit; `reason`: the same without the file, for a SpecError whose field is the file."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(f"{path} {reason}")
        self.path, self.reason = str(path), reason


def read_bytes(path: str | Path, *, limit: int, what: str) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them: TooLarge when it is larger
    (checked before reading, and again while reading: a file that grows, or lies in st_size).
    `what` completes "over the N bytes <what> can be" ('a checkpoint's dskit.json'). OSError as is."""
    p = Path(path)
    st = os.stat(p)
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block, /dev/zero would never end
        raise TooLarge(p, "is not a regular file")
    if st.st_size > limit:
        raise TooLarge(p, f"is {st.st_size:,} bytes, over the {limit:,} {what} can be")
    with p.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(p, f"is over the {limit:,} bytes {what} can be")
    return data


def json_depth(v: Any) -> int:
    """How deep a parsed JSON value nests (a scalar is 0), without recursion."""
    deepest, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        kids = x.values() if isinstance(x, dict) else x if isinstance(x, list) else None
        if kids is not None:
            deepest = max(deepest, d)
            stack.extend((k, d + 1) for k in kids)
    return deepest


def parse_json(raw: bytes | str, where: str | Path, depth: int = MAX_DEPTH) -> Any:
    """`raw` (UTF-8) parsed, at most `depth` levels deep (TooLarge beyond, naming `where`). A file that
    is not UTF-8 or not JSON raises ValueError (UnicodeDecodeError, JSONDecodeError) for the caller's
    own words."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    try:
        data = json.loads(text)
        deep = json_depth(data) > depth
    except RecursionError:  # the C parser's own guard, far deeper than `depth`
        deep = True
    if deep:
        raise TooLarge(where, f"nests deeper than {depth} levels")
    return data


def read_json(path: str | Path, *, limit: int, what: str, depth: int = MAX_DEPTH) -> Any:
    """read_bytes then parse_json: the one way dskit reads a JSON file it did not just write."""
    return parse_json(read_bytes(path, limit=limit, what=what), path, depth)


def iter_jsonl(path: str | Path, *, line_limit: int, what: str) -> Iterator[Any]:
    """Each line of a JSON-lines file parsed (a line that is not JSON yields None: a torn write), read
    one line at a time so the file's size costs no memory; TooLarge for a line over `line_limit`."""
    p = Path(path)
    st = os.stat(p)
    if not stat.S_ISREG(st.st_mode):
        raise TooLarge(p, "is not a regular file")
    with p.open("rb") as f:
        n = 0
        while line := f.readline(line_limit + 1):
            n += 1
            if len(line) > line_limit:
                raise TooLarge(p, f"line {n} is over the {line_limit:,} bytes a line of {what} can be")
            try:
                yield parse_json(line, f"{p} line {n}")
            except TooLarge:
                raise
            except ValueError:
                yield None
