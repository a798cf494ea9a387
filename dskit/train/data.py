"""Token data: tokenizers, `dskit data prepare` shards, the embedded corpus, and deterministic sampling.

Shard directory layout (format 2, written by `prepare`, read by `TokenData.open`):
    index.json     {"format": 2, "kind": "text"|"chat", "dtype": "uint16"|"uint32",
                    "files": [[stem, n_tokens, n_documents], ...], "tokenizer": "byte" | path,
                    "vocab_size": int, "eos_id": int, "documents": int}
    tokens-00000.bin   flat token stream (documents back to back; text documents end with EOS)
    docs-00000.bin     uint64: the end offset of each document in the stream (sample boundaries)
    mask-00000.bin     (chat only) uint8 per token: 1 where the token is a training target (assistant
                       turns), 0 where it is context only (system/user turns, the template's markup)

Two ways to cut training samples, chosen by the data's kind:
- text (continued pre-training): windows of seq_len+1 tokens that cross document boundaries, every
  token a target, as in GPT-style pre-training;
- chat (fine-tuning): whole samples packed into rows of seq_len, never split; each sample's position
  ids restart at 0, which transformers' DeepSeek path turns into attention confined to the sample
  (a block-diagonal causal mask for SDPA/eager, varlen for FlashAttention).

Sampling is a pure function of (seed, global sample number): resuming at step N reproduces exactly the
batches an uninterrupted run would have seen, with no loader state to save.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dskit.atomic import atomic_dir
from dskit.errors import SpecError
from dskit.spec import MIXTURE_BLOCK

FORMAT = 2  # 1: tokens only (no document ends, no loss mask); refused with a re-prepare hint
SHARD_TOKENS = 1 << 28  # 256M tokens (512 MiB in uint16) per file


# --------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes 0-255, then PAD 256, BOS 257, EOS 258. Needs no files; fits tiny models' vocab."""

    name = fingerprint = "byte"
    vocab_size = 259
    pad_id, bos_id, eos_id = 256, 257, 258

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer directory. local_files_only: nothing is downloaded."""

    def __init__(self, path: str):
        if not Path(path).is_dir():
            raise SpecError("--tokenizer", f"{path} is not a directory; use 'byte' or a local tokenizer dir")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises many types for a bad dir
            raise SpecError("--tokenizer", f"cannot load a tokenizer from {path}: {e}") from None
        self.name = str(Path(path).resolve())
        self.vocab_size = len(self._tok)
        vocab = json.dumps(sorted(self._tok.get_vocab().items()), ensure_ascii=False).encode()
        self.fingerprint = hashlib.sha256(vocab).hexdigest()[:16]  # same tokens, same ids
        eos = self._tok.eos_token_id
        self.eos_id = eos if eos is not None else self.vocab_size - 1

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False), dtype=np.uint32)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))

    def render_chat(self, messages: list[dict], *, generation_prompt: bool) -> str:
        """The conversation as text through the tokenizer's own chat template (DeepSeek's for DeepSeek
        tokenizers); special tokens stay in the text and `encode` maps them back to their ids."""
        if not self._tok.chat_template:
            raise SpecError(
                "--tokenizer", f"{self.name} has no chat template (tokenizer_config.json 'chat_template')"
            )
        import jinja2

        try:
            return self._tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except jinja2.TemplateError as e:  # syntax errors, and templates that raise_exception(...)
            raise SpecError("--tokenizer", f"{self.name}: its chat template failed: {e}") from None


def tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)


# --------------------------------------------------------------------------- corpus


def embedded_corpus() -> list[str]:
    """Real English text that ships with every CPython: the interpreter's own reference topics
    (pydoc_data, ~460 KB). Enough for a tiny model to visibly learn, with nothing to download."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


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


def _records(paths: list[str], text_field: str = "text") -> Iterator[str | list[dict]]:
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


def _has_messages(paths: list[str], text_field: str) -> bool:
    """Whether any record is a chat record: the schema says it for Parquet/Arrow; JSONL is scanned
    (stopping at the first chat record)."""
    for p in paths:
        path = _check_input(p)
        kind = "dir" if path.is_dir() else _input_kind(p, path)[0]
        if kind in ("dir", "parquet", "arrow"):
            files = _hf_dir_files(p, path) if path.is_dir() else [path]
            if _column(p, _arrow_schema(p, files[0]).names, text_field) == "messages":
                return True
        elif kind == "jsonl" and any(isinstance(r, list) for r in _records([p], text_field)):
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
        return _check_messages(where, v)
    if not isinstance(v, str):
        raise SpecError(where, f"'{col}' is {type(v).__name__}, not a string")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise SpecError(where, f"'{col}' holds an unpaired surrogate escape") from None
    return v


ROLES = ("system", "user", "assistant")


def _check_messages(where: str, msgs) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise SpecError(where, "'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise SpecError(
                f"{where} messages[{i}]", f"needs a 'role' (one of {', '.join(ROLES)}) and a string 'content'"
            )
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError:
            raise SpecError(
                f"{where} messages[{i}]", "'content' holds an unpaired surrogate escape"
            ) from None
    if not any(m["role"] == "assistant" for m in msgs):
        raise SpecError(where, "no 'assistant' message: nothing to train on")
    if msgs[0]["role"] == "assistant":
        raise SpecError(where, "starts with an 'assistant' message: a conversation opens with system or user")
    return msgs


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
                    yield _check_messages(f"{p}:{n}", rec["messages"])
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


def pack(docs: Iterable[str], tok) -> Iterator[np.ndarray]:
    """Documents as token arrays, each followed by EOS (sequence packing: windows cross boundaries)."""
    eos = np.array([tok.eos_id], dtype=np.uint32)
    for d in docs:
        yield np.concatenate([tok.encode(d), eos])


def encode_chat(messages: list[dict], tok) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) of one conversation rendered with the tokenizer's own chat template; mask 1 on
    the assistant turns' tokens (their content and the template's end-of-turn, so the model learns to
    stop), 0 on everything else.

    The template is rendered once per assistant turn: the conversation before it with the generation
    prompt (`Assistant:` in DeepSeek's template) is context; the text the full turn adds after that is
    the target. Each piece is tokenized on its own, so the mask follows the turn boundaries exactly
    (tokenizing the whole text could merge characters across a boundary into one token)."""
    render = getattr(tok, "render_chat", None)
    if render is None:
        raise SpecError(
            "--tokenizer",
            "chat records ('messages') need a local tokenizer dir with a chat template, not 'byte'",
        )
    pieces: list[tuple[str, int]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(messages[:i], generation_prompt=True)
        full = render(messages[: i + 1], generation_prompt=False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise SpecError(
                "--tokenizer",
                f"{tok.name}: its chat template does not render a conversation as a prefix of the longer one; "
                "loss masks need a prefix-stable template",
            )
        pieces += [(prompt[len(done) :], 0), (full[len(prompt) :], 1)]
        done = full
    last = render(messages, generation_prompt=False)
    if not last.startswith(done):
        raise SpecError("--tokenizer", f"{tok.name}: its chat template is not prefix-stable")
    pieces.append((last[len(done) :], 0))  # trailing non-assistant turns: context with nothing to predict
    ids = [tok.encode(t) for t, _ in pieces]
    mask = [np.full(len(x), k, dtype=np.uint8) for x, (_, k) in zip(ids, pieces, strict=True)]
    return np.concatenate(ids).astype(np.uint32), np.concatenate(mask)


EVAL_DIR = "eval"  # the held-out split inside a prepared dir (`--eval-fraction`)


def held_out(doc: int, fraction: float) -> bool:
    """Whether document number `doc` (input order) belongs to the eval split: a hash of the number, so
    the split is the same whatever the process count or the corpus size, and about `fraction` of it."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(doc.to_bytes(8, "little"), digest_size=8).digest(), "little")
    return h < fraction * 2**64


class ShardWriter:
    """Token, document-end and (chat) mask files of one shard directory, cut every SHARD_TOKENS."""

    def __init__(self, out: Path, dtype, chat: bool):
        self.out, self.dtype, self.chat = out, dtype, chat
        self.files: list[list] = []
        self.docs = 0
        self._reset()

    def _reset(self) -> None:
        self.buf: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.ends: list[int] = []
        self.buffered = 0

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self.buf.append(ids)
        self.masks.append(mask)
        self.buffered += len(ids)
        self.ends.append(self.buffered)
        self.docs += 1
        if self.buffered >= SHARD_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self.buffered:
            return
        self.out.mkdir(exist_ok=True)
        stem = f"{len(self.files):05d}"
        np.concatenate(self.buf).astype(self.dtype).tofile(self.out / f"tokens-{stem}.bin")
        np.asarray(self.ends, dtype=np.uint64).tofile(self.out / f"docs-{stem}.bin")
        if self.chat:
            np.concatenate(self.masks).tofile(self.out / f"mask-{stem}.bin")
        self.files.append([stem, self.buffered, len(self.ends)])
        self._reset()

    def close(self, tok) -> None:
        self.flush()
        index = {
            "format": FORMAT,
            "kind": "chat" if self.chat else "text",
            "dtype": np.dtype(self.dtype).name,
            "files": self.files,
            "tokenizer": tok.name,
            "tokenizer_fingerprint": tok.fingerprint,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "documents": self.docs,
        }
        (self.out / "index.json").write_text(json.dumps(index, indent=1) + "\n")

    @property
    def tokens(self) -> int:
        return sum(f[1] for f in self.files)


BATCH_RECORDS = 256  # records per task sent to a tokenizer process


def _encode(rec: str | list[dict], tok) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens, loss mask, input bytes for the progress bar) of one record."""
    if isinstance(rec, list):
        ids, mask = encode_chat(rec, tok)
        return ids, mask, sum(len(m["content"].encode("utf-8")) for m in rec)
    ids = next(pack([rec], tok))
    return ids, np.ones(len(ids), dtype=np.uint8), len(rec.encode("utf-8", errors="replace"))


_worker_tok = None


def _worker_init(spec: str) -> None:
    global _worker_tok
    _worker_tok = tokenizer(spec)


def _worker_encode(batch: list) -> list:
    return [_encode(r, _worker_tok) for r in batch]


def _batches(records: Iterator, size: int) -> Iterator[list]:
    batch: list = []
    for r in records:
        batch.append(r)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _encoded(records: Iterator, tok, spec: str, workers: int) -> Iterator[list]:
    """Encoded batches of records in input order. With workers > 1 each batch goes to a process pool
    and at most 2 x workers batches are in flight, so memory stays bounded whatever the corpus size
    (Pool.imap would read the whole input ahead). Spawned, not forked: the tokenizers library's own
    thread pool does not survive a fork."""
    if workers <= 1:
        for batch in _batches(records, BATCH_RECORDS):
            yield [_encode(r, tok) for r in batch]
        return
    import collections
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_worker_init, initargs=(spec,)) as pool:
        pending: collections.deque = collections.deque()
        for batch in _batches(records, BATCH_RECORDS):
            pending.append(pool.apply_async(_worker_encode, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def prepare(
    inputs: list[str],
    output: str,
    *,
    tokenizer: str = "byte",
    force: bool = False,
    eval_fraction: float = 0.0,
    text_field: str = "text",
    workers: int = 1,
) -> Path:
    """Tokenize text/jsonl files into a shard directory, atomically (temp dir, then rename).

    Any record with `messages` makes the set a chat set: every document gets a loss mask (text documents
    are all target), and training packs whole samples. With `eval_fraction`, about that share of the
    documents goes to DIR/eval instead (`held_out`). `workers` processes tokenize batches of records;
    the output is byte-identical whatever their number (results are written in input order)."""
    from tqdm import tqdm

    if not 0 <= eval_fraction < 1:
        raise SpecError(
            "--eval-fraction", f"{eval_fraction} is outside [0, 1); e.g. 0.01 holds out 1% of the documents"
        )
    out = Path(output).resolve()
    tok = globals()["tokenizer"](tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    # The kind must be known before the first shard is written (text shards carry no mask): one cheap
    # pass over the JSON lines decides it.
    chat = _has_messages(inputs, text_field)
    with atomic_dir(out, kind="data", force=force) as tmp:
        train, held = ShardWriter(tmp, dtype, chat), ShardWriter(tmp / EVAL_DIR, dtype, chat)
        total = sum(Path(p).stat().st_size for p in inputs if Path(p).is_file())
        with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=None) as bar:
            n = 0
            for encoded in _encoded(_records(inputs, text_field), tok, tokenizer, workers):
                for ids, mask, size in encoded:
                    (held if held_out(n, eval_fraction) else train).add(ids, mask)
                    n += 1
                    bar.update(size)
        if not train.docs:
            raise SpecError(
                "inputs", "no documents found" if not held.docs else "every document was held out for eval"
            )
        if eval_fraction and not held.docs:
            raise SpecError(
                "--eval-fraction",
                f"{eval_fraction} of {train.docs} documents held out none; raise it or give an eval dir (data.eval_path)",
            )
        train.close(tok)
        if held.docs:
            held.close(tok)
    kind = "chat (loss on assistant turns)" if chat else "text"
    split = (
        f"; eval split {held.docs} documents, {held.tokens} tokens in {out / EVAL_DIR}" if held.docs else ""
    )
    print(f"wrote {out}: {train.docs} {kind} documents, {train.tokens} tokens, tokenizer {tok.name}{split}")
    return out


# --------------------------------------------------------------------------- reading and sampling


@dataclass
class Shard:
    tokens: np.ndarray  # memmap
    ends: np.ndarray  # uint64 document end offsets (memmap)
    mask: np.ndarray | None  # uint8 memmap, chat only


@dataclass
class TokenData:
    """Every shard memory-mapped on its own: nothing is concatenated into RAM, whatever the corpus size."""

    shards: list[Shard]
    vocab_size: int
    source: str
    kind: str = "text"
    eos_id: int = 0
    tokenizer: str | None = None  # the fingerprint of its tokenizer's vocabulary (None: an older index)

    def same_tokens_as(self, other: TokenData) -> str | None:
        """Why batches of `other` could not be mixed with or compared to this data's, or None."""
        if (self.kind, self.vocab_size, self.eos_id) != (other.kind, other.vocab_size, other.eos_id):
            return (
                f"is {other.kind} data with vocabulary {other.vocab_size}, and {self.source} is {self.kind} "
                f"with {self.vocab_size}: prepare both with the same tokenizer and inputs of one kind"
            )
        if self.tokenizer and other.tokenizer and self.tokenizer != other.tokenizer:
            return (
                f"was prepared with another tokenizer than {self.source} (same vocabulary size, different "
                "tokens): prepare both with the same tokenizer"
            )
        return None

    @property
    def n_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.shards)

    @classmethod
    def open(cls, path: str | None) -> TokenData:
        if path is None:
            tok = ByteTokenizer()
            stream = np.concatenate(list(pack(embedded_corpus(), tok))).astype(np.uint16)
            ends = np.asarray([len(stream)], dtype=np.uint64)
            return cls(
                [Shard(stream, ends, None)],
                tok.vocab_size,
                "embedded corpus (pydoc_data, byte tokenizer)",
                "text",
                tok.eos_id,
            )
        d = Path(path)
        idx = d / "index.json"
        if not idx.is_file():
            raise SpecError("data.path", f"{idx} not found; create shards with `dskit data prepare`")
        try:
            meta = json.loads(idx.read_text())
            if meta.get("format") != FORMAT:
                raise SpecError(
                    "data.path",
                    f"{d} holds shard format {meta.get('format')!r}, this dskit reads format {FORMAT} "
                    "(document ends and loss masks); prepare it again with `dskit data prepare`",
                )
            kind, dtype = meta["kind"], np.dtype(meta["dtype"])
            if kind not in ("text", "chat"):
                raise ValueError(f"kind {kind!r}")
            shards = []
            for stem, n, docs in meta["files"]:
                parts = {"tokens": (n, dtype), "docs": (docs, np.dtype(np.uint64))}
                if kind == "chat":
                    parts["mask"] = (n, np.dtype(np.uint8))
                maps = {}
                for what, (count, dt) in parts.items():
                    f = d / f"{what}-{stem}.bin"
                    if not f.is_file() or f.stat().st_size != count * dt.itemsize:
                        raise SpecError("data.path", f"{f} is missing or truncated (expected {count} values)")
                    maps[what] = np.memmap(f, dtype=dt, mode="r")
                shards.append(Shard(maps["tokens"], maps["docs"], maps.get("mask")))
        except (KeyError, ValueError, TypeError) as e:
            raise SpecError("data.path", f"{idx} is not a dskit shard index: {e}") from None
        return cls(
            shards,
            int(meta["vocab_size"]),
            str(d),
            kind,
            int(meta["eos_id"]),
            meta.get("tokenizer_fingerprint"),
        )


@dataclass
class Batch:
    """One micro-batch: [n, seq_len] int64 each; labels are IGNORE_INDEX where no loss is taken;
    position_ids is None for text windows (positions 0..seq_len-1, attention across the window)."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray | None


IGNORE_INDEX = -100  # as dskit.train.loss (kept here so the data module does not import torch)


class Sampler:
    """Training samples addressed by global sample number, in a seeded permutation per epoch.

    Sample g of the run is unit perm_e[g mod U] with e = g // U: any rank can compute its samples for
    any step without state, so resume is exact and ranks never overlap. A unit is a window of seq_len+1
    tokens (text; windows stay inside one shard, losing under seq_len tokens per 256M-token shard) or a
    pack of whole samples (chat: the samples in a seeded order, filled greedily into rows of seq_len).
    """

    def __init__(self, data: TokenData, seq_len: int, seed: int, *, packing: str = "pack"):
        self.data, self.seq_len, self.seed = data, seq_len, seed
        self.chat = data.kind == "chat"
        self.truncated = 0  # chat samples cut to seq_len+1 (text windows cut nothing)
        if self.chat:
            self._build_packs(packing)
            self.windows = len(self._pack_first) - 1
        else:
            per = [max(0, (len(s.tokens) - 1) // seq_len) for s in data.shards]
            self._shard_first = np.cumsum([0, *per])
            self.windows = int(self._shard_first[-1])
        if self.windows < 1:
            raise SpecError(
                "data.path",
                f"{data.source} has {data.n_tokens} tokens, fewer than seq_len+1 ({seq_len + 1})",
            )
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def describe(self) -> str:
        return f"{self.data.source}, {self.data.kind}, {self.data.n_tokens} tokens"

    def _build_packs(self, packing: str) -> None:
        """Chat packs, once: document d spans tokens [start, end) of its shard and takes L-1 row slots
        (its inputs are tokens[:-1], its labels tokens[1:]); one longer than seq_len+1 is cut to that
        (counted and logged by the caller through `truncated`). `packing='pad'`: one sample per row."""
        starts, ends, shard_of = [], [], []
        for i, s in enumerate(self.data.shards):
            e = s.ends.astype(np.int64)
            starts.append(np.concatenate([[0], e[:-1]]))
            ends.append(e)
            shard_of.append(np.full(len(e), i, dtype=np.int32))
        self._starts, self._ends = np.concatenate(starts), np.concatenate(ends)
        self._shard = np.concatenate(shard_of)
        lengths = np.minimum(self._ends - self._starts, self.seq_len + 1)
        self.truncated = int(((self._ends - self._starts) > self.seq_len + 1).sum())
        order = np.random.default_rng([self.seed, 0xDA7A]).permutation(len(lengths))
        order = order[lengths[order] >= 2]  # one token predicts nothing
        first, used = [0], 0
        for j, d in enumerate(order):
            need = int(lengths[d]) - 1
            if used and (packing == "pad" or used + need > self.seq_len):
                first.append(j)
                used = 0
            used += need
        if len(order):
            first.append(len(order))
        self._order = order
        self._pack_first = np.asarray(first if len(order) else [0], dtype=np.int64)

    def _unit(self, g: int) -> int:
        epoch, i = divmod(g, self.windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._perm_epoch = epoch
        return int(self._perm[i])

    def _window(self, g: int) -> tuple[Shard, int]:
        w = self._unit(g)
        shard = int(np.searchsorted(self._shard_first, w, side="right")) - 1
        return self.data.shards[shard], (w - int(self._shard_first[shard])) * self.seq_len

    def batch(self, first_sample: int, n: int) -> np.ndarray:
        """[n, seq_len + 1] int64 token windows (text data) for global samples first_sample ...+n-1."""
        if self.chat:
            raise SpecError("data.path", f"{self.data.source} is chat data: read it with Sampler.get")
        out = np.empty((n, self.seq_len + 1), dtype=np.int64)
        for j in range(n):
            shard, s = self._window(first_sample + j)
            out[j] = shard.tokens[s : s + self.seq_len + 1]
        return out

    def get(self, first_sample: int, n: int) -> Batch:
        """The micro-batch of global samples first_sample .. first_sample + n - 1."""
        if not self.chat:
            w = self.batch(first_sample, n)
            return Batch(w[:, :-1], w[:, 1:], None)
        L = self.seq_len
        inputs = np.full((n, L), self.data.eos_id, dtype=np.int64)
        labels = np.full((n, L), IGNORE_INDEX, dtype=np.int64)
        # Padding gets its own run of positions 0.. so it reads as one more (label-less) sample.
        pos = np.tile(np.arange(L, dtype=np.int64), (n, 1))
        for j in range(n):
            p = self._unit(first_sample + j)
            at = 0
            for d in self._order[self._pack_first[p] : self._pack_first[p + 1]]:
                sh = self.data.shards[int(self._shard[d])]
                s = int(self._starts[d])
                e = min(int(self._ends[d]), s + L + 1)
                toks = np.asarray(sh.tokens[s:e], dtype=np.int64)
                keep = np.asarray(sh.mask[s + 1 : e], dtype=bool)
                k = len(toks) - 1
                inputs[j, at : at + k] = toks[:-1]
                labels[j, at : at + k] = np.where(keep, toks[1:], IGNORE_INDEX)
                pos[j, at : at + k] = np.arange(k)
                at += k
            if at < L:
                pos[j, at:] = np.arange(L - at)
        return Batch(inputs, labels, pos)


class Mixture:
    """Samples drawn from several sources by weight, as a pure function of (seed, global sample number).

    Sample numbers are cut into blocks of BLOCK; in every block each source gets its share of the
    slots (largest remainder, so the shares are exact per block) and the slots are shuffled by a
    generator seeded with (seed, block). Sample g is then source i's sample number
    (block x slots_i + its rank among the block's slots of source i), read through that source's own
    Sampler: no state to save, so resume stays exact, and each source runs through its own epochs.
    """

    BLOCK = MIXTURE_BLOCK

    def __init__(self, samplers: list[Sampler], weights: list[float], seed: int):
        self.samplers, self.seed = samplers, seed
        w = np.asarray(weights, dtype=np.float64)
        share = w / w.sum() * self.BLOCK
        n = np.floor(share).astype(np.int64)
        rest = self.BLOCK - int(n.sum())
        n[np.argsort(-(share - n), kind="stable")[:rest]] += 1
        self.per_block = n
        self.data = samplers[0].data
        self.chat = samplers[0].chat
        self._block, self._src, self._idx = -1, np.empty(0, np.int64), np.empty(0, np.int64)

    @property
    def truncated(self) -> int:
        return sum(s.truncated for s in self.samplers)

    def describe(self) -> str:
        parts = [
            f"{s.data.source} x{int(k)}/{self.BLOCK}"
            for s, k in zip(self.samplers, self.per_block, strict=True)
        ]
        return "mixture of " + ", ".join(parts)

    def _slots(self, block: int) -> None:
        if block == self._block:
            return
        src = np.repeat(np.arange(len(self.samplers)), self.per_block)
        src = src[np.random.default_rng([self.seed, 0x313C, block]).permutation(self.BLOCK)]
        idx = np.empty(self.BLOCK, dtype=np.int64)
        for i in range(len(self.samplers)):
            at = np.flatnonzero(src == i)
            idx[at] = block * self.per_block[i] + np.arange(len(at))
        self._block, self._src, self._idx = block, src, idx

    def source_of(self, g: int) -> tuple[int, int]:
        """(source, that source's own sample number) of global sample g."""
        block, j = divmod(g, self.BLOCK)
        self._slots(block)
        return int(self._src[j]), int(self._idx[j])

    def get(self, first_sample: int, n: int) -> Batch:
        rows = []
        for g in range(first_sample, first_sample + n):
            i, k = self.source_of(g)
            rows.append(self.samplers[i].get(k, 1))
        pos = None if rows[0].position_ids is None else np.concatenate([r.position_ids for r in rows])
        return Batch(
            np.concatenate([r.input_ids for r in rows]), np.concatenate([r.labels for r in rows]), pos
        )


def sample_index(step: int, micro: int, rank: int, *, grad_accum: int, world: int, micro_batch: int) -> int:
    """Global number of the first sample of (optimizer step, micro step, rank)."""
    return ((step * grad_accum + micro) * world + rank) * micro_batch
