"""The input readers of `dskit data prepare`: files and `datasets` dirs as records, in input order.

A record is a text or a chat record's `messages` list (checked by `chat.check_messages`). Nothing is
downloaded: a hub name or URL is refused with how to fetch it first.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dskit.data.chat import check_messages
from dskit.errors import SpecError


def _looks_remote(p: str) -> bool:
    """A URL, or a hub dataset name (ORG/NAME: no file extension, and ORG is no local dir). Nothing is
    downloaded, so such an input is told how to fetch it first; a missing local file is "not found"."""
    if re.match(r"^(hf|https?)://", p):
        return True
    org, _, name = p.partition("/")
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w-]+", p)) and "." not in name and not Path(org).exists()


TEXT_SUFFIXES = (".txt", ".text", ".md")
INPUT_TYPES = ".txt/.text/.md (one document per file), .jsonl, each of those .gz or .zst, .parquet, .arrow"


def _input_kind(p: str, path: Path) -> tuple[str, str]:
    """(format, compression) from the name: jsonl/parquet/arrow/text and none/gz/zst. A name outside
    these is refused: read as text, a .json or .csv file would become one garbled document."""
    name = path.name.lower()
    comp = "none"
    for c in ("gz", "zst"):
        if name.endswith("." + c):
            comp, name = c, name[: -len(c) - 1]
    if name.endswith(".jsonl"):
        return "jsonl", comp
    if name.endswith(".parquet") and comp == "none":
        return "parquet", comp
    if name.endswith(".arrow") and comp == "none":
        return "arrow", comp
    if name.endswith(TEXT_SUFFIXES):
        return "text", comp
    raise SpecError(f"{p}", f"unknown input type; one of: {INPUT_TYPES}, or a datasets save_to_disk dir")


def _open_text(p: str, path: Path, comp: str, errors: str = "strict"):
    """A text stream over the file, decompressed as its name says (BOM dropped). JSONL must be UTF-8;
    plain text takes `errors="replace"` (a stray byte in a large corpus is not worth refusing it)."""
    if comp == "gz":
        import gzip

        return gzip.open(path, "rt", encoding="utf-8-sig", errors=errors)
    if comp == "zst":
        return io.TextIOWrapper(io.BufferedReader(_ZstdReader(path)), encoding="utf-8-sig", errors=errors)
    return path.open(encoding="utf-8-sig", errors=errors)


class _ZstdReader(io.RawIOBase):
    """Decompresses every frame of a .zst file, and raises EOFError where it ends inside a frame
    (zstandard's stream_reader returns the bytes it has, so a cut-off file read as a shorter one)."""

    def __init__(self, path: Path):
        import zstandard

        self._f, self._new = path.open("rb"), zstandard.ZstdDecompressor().decompressobj
        self._d, self._buf, self._at, self._started = self._new(), b"", 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        import zstandard

        while self._at == len(self._buf):
            chunk = self._d.unused_data if self._d.eof else b""
            if self._d.eof:
                self._d, self._started = self._new(), False
            chunk = chunk or self._f.read(1 << 16)  # 64 KiB in: its output stays small
            if not chunk:
                if self._started:
                    raise EOFError("the zstd stream ends inside a frame (truncated file?)")
                return 0
            self._started = True
            try:
                self._buf, self._at = self._d.decompress(chunk), 0
            except zstandard.ZstdError as e:
                raise EOFError(f"not a zstd stream or damaged: {e}") from None
            if self._d.eof and not self._d.unused_data:
                self._started = False
        n = min(len(b), len(self._buf) - self._at)
        b[:n] = memoryview(self._buf)[self._at : self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def _check_input(p: str) -> Path:
    path = Path(p)
    if not path.exists():
        if _looks_remote(p):
            raise SpecError(
                "inputs",
                f"{p} is not a local path; dskit downloads nothing: fetch it first (e.g. `huggingface-cli download "
                "--repo-type dataset NAME --local-dir DIR`, or datasets' save_to_disk) and give the local files or dir",
            )
        raise SpecError("inputs", f"{p} not found")
    if not path.is_file() and not path.is_dir():
        raise SpecError(
            f"{p}",
            "is not a regular file (a pipe or a device?): inputs are read twice (the chat check, then "
            "tokenizing); write it to a file first",
        )
    return path


def records(paths: list[str], text_field: str = "text") -> Iterator[str | list[dict]]:
    """Documents in input order: a text, or a chat record's `messages` list. Streams every input
    (JSONL line by line, Parquet and Arrow by record batch), so memory does not grow with its size."""
    for p in paths:
        path = _check_input(p)
        if path.is_dir():
            yield from _read_arrow(p, _hf_dir_files(p, path), text_field)
            continue
        kind, comp = _input_kind(p, path)
        if kind == "jsonl":
            yield from _read_jsonl(p, path, comp, text_field)
        elif kind == "parquet":
            yield from _read_parquet(p, path, text_field)
        elif kind == "arrow":
            yield from _read_arrow(p, [path], text_field)
        else:
            try:
                with _open_text(p, path, comp, errors="replace") as f:
                    yield f.read()
            except (OSError, EOFError) as e:
                raise SpecError(f"{p}", f"cannot read it: {getattr(e, 'strerror', None) or e}") from None


def has_messages(paths: list[str], text_field: str) -> bool:
    """Whether any record is a chat record: the schema says it for Parquet/Arrow; JSONL is scanned
    (stopping at the first chat record)."""
    for p in paths:
        path = _check_input(p)
        kind = "dir" if path.is_dir() else _input_kind(p, path)[0]
        if kind in ("dir", "parquet", "arrow"):
            files = _hf_dir_files(p, path) if path.is_dir() else [path]
            if _column(p, _arrow_schema(p, files[0]).names, text_field) == "messages":
                return True
        elif kind == "jsonl" and any(isinstance(r, list) for r in records([p], text_field)):
            return True  # text files never hold chat records: not read here
    return False


def _column(p: str, names: list[str], text_field: str) -> str:
    if "messages" in names:
        return "messages"
    if text_field in names:
        return text_field
    raise SpecError(
        f"{p}",
        f"has columns {', '.join(names)}; none is '{text_field}' (--text-field) or 'messages' (chat)",
    )


def _arrow_schema(p: str, path: Path):
    import pyarrow.parquet as pq

    if path.suffix.lower() == ".parquet":
        try:
            return pq.read_schema(path)
        except Exception as e:  # pyarrow raises ArrowInvalid/OSError for a file that is not Parquet
            raise SpecError(f"{p}", f"not a Parquet file: {e}") from None
    with _arrow_reader(path) as reader:
        return reader.schema


@contextlib.contextmanager
def _arrow_reader(path: Path):
    """The record batch reader of an Arrow IPC stream (datasets' save_to_disk) or file (Feather v2)."""
    import pyarrow as pa

    src = pa.memory_map(str(path))
    try:
        try:
            reader = pa.ipc.open_stream(src)
        except Exception:
            src.seek(0)
            try:
                f = pa.ipc.open_file(src)
            except Exception as e:
                raise SpecError(f"{path}", f"not an Arrow stream or file: {e}") from None
            reader = _Batches(f.schema, (f.get_batch(i) for i in range(f.num_record_batches)))
        yield reader
    finally:
        src.close()


@dataclass
class _Batches:
    """An IPC file's batches with the stream reader's interface (schema, iteration): read one at a time."""

    schema: object
    batches: Iterator

    def __iter__(self):
        return iter(self.batches)


def _hf_dir_files(p: str, path: Path) -> list[Path]:
    """The Arrow files of a `datasets` save_to_disk directory, in its own order (state.json)."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(q.name for q in path.iterdir() if (q / "state.json").is_file())
        raise SpecError(
            f"{p}", f"is a DatasetDict; give one split's dir (splits: {', '.join(splits) or 'none'})"
        )
    state = path / "state.json"
    if not state.is_file():
        raise SpecError(
            f"{p}",
            "is a directory; give the .txt/.jsonl/.parquet files in it (e.g. DIR/*.jsonl), or a datasets "
            "save_to_disk dir (this one has no state.json)",
        )
    try:
        names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError):
        raise SpecError(f"{state}", "is not a datasets state.json (no _data_files list)") from None
    if not names:
        raise SpecError(f"{p}", "is a datasets dir without data files (an empty dataset)")
    for n in names:  # plain names only: a state.json cannot point outside its dir
        if not isinstance(n, str) or Path(n).name != n or not (path / n).is_file():
            raise SpecError(f"{state}", f"names {n!r}, which is not a file in {p}")
    return [path / n for n in names]


def _read_parquet(p: str, path: Path, text_field: str) -> Iterator[str | list[dict]]:
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError for a file that is not Parquet
        raise SpecError(f"{p}", f"not a Parquet file: {e}") from None
    col = _column(p, f.schema_arrow.names, text_field)
    n = 0
    for batch in _guarded(p, f.iter_batches(batch_size=1024, columns=[col])):
        for v in batch.column(0).to_pylist():
            n += 1
            yield _value(f"{p} row {n}", col, v)


def _guarded(p: str, batches: Iterable) -> Iterator:
    """Record batches, where a damaged or cut-off file is one line naming it, not pyarrow's traceback."""
    import pyarrow as pa

    it = iter(batches)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            raise SpecError(f"{p}", f"cannot read it (damaged or cut off?): {e}") from None
        yield batch


def _read_arrow(p: str, files: list[Path], text_field: str) -> Iterator[str | list[dict]]:
    n = 0
    for path in files:
        with _arrow_reader(path) as reader:
            col = _column(p, reader.schema.names, text_field)
            for batch in _guarded(str(path), reader):
                for v in batch.column(col).to_pylist():
                    n += 1
                    yield _value(f"{p} row {n}", col, v)


def _value(where: str, col: str, v) -> str | list[dict]:
    if col == "messages":
        return check_messages(where, v)
    if not isinstance(v, str):
        raise SpecError(where, f"'{col}' is {type(v).__name__}, not a string")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise SpecError(where, f"'{col}' holds an unpaired surrogate escape") from None
    return v


def _read_jsonl(p: str, path: Path, comp: str = "none", field: str = "text") -> Iterator[str | list[dict]]:
    n = 0
    try:
        with _open_text(p, path, comp) as f:  # a leading BOM (Windows editors) is dropped
            for n, line in enumerate(f, 1):  # noqa: B007 - n names the line in the error below
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, ValueError, RecursionError):
                    raise SpecError(f"{p}:{n}", "not a JSON line") from None
                if isinstance(rec, dict) and "messages" in rec:
                    yield check_messages(f"{p}:{n}", rec["messages"])
                    continue
                if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
                    raise SpecError(
                        f"{p}:{n}", f"each JSON line needs a string '{field}' field or a 'messages' list"
                    )
                try:
                    rec[field].encode("utf-8")
                except UnicodeEncodeError:  # a "\ud800" escape: no UTF-8 bytes to tokenize
                    raise SpecError(f"{p}:{n}", f"'{field}' holds an unpaired surrogate escape") from None
                yield rec[field]
    except UnicodeDecodeError:
        raise SpecError(f"{p}", "not UTF-8 text (JSONL must be UTF-8)") from None
    except (OSError, EOFError) as e:  # gzip/zstd raise these for a damaged or truncated stream
        raise SpecError(f"{p}", f"cannot read it: {getattr(e, 'strerror', None) or e}") from None
