"""Token data: tokenizers, `dskit data prepare` shards, the embedded corpus, and deterministic sampling.

Shard directory layout (written by `prepare`, read by `TokenData.open`):
    index.json     {"format": 1, "dtype": "uint16"|"uint32", "files": [[name, n_tokens], ...],
                    "tokenizer": "byte" | path, "vocab_size": int, "eos_id": int, "documents": int}
    tokens-00000.bin ...   flat token streams (documents packed, separated by EOS)

Sampling is a pure function of (seed, global sample number): resuming at step N reproduces exactly the
batches an uninterrupted run would have seen, with no loader state to save.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dskit.atomic import atomic_dir
from dskit.errors import SpecError

FORMAT = 1
SHARD_TOKENS = 1 << 28  # 256M tokens (512 MiB in uint16) per file


# --------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes 0-255, then PAD 256, BOS 257, EOS 258. Needs no files; fits tiny models' vocab."""

    name = "byte"
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
        eos = self._tok.eos_token_id
        self.eos_id = eos if eos is not None else self.vocab_size - 1

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False), dtype=np.uint32)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))


def tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)


# --------------------------------------------------------------------------- corpus


def embedded_corpus() -> list[str]:
    """Real English text that ships with every CPython: the interpreter's own reference topics
    (pydoc_data, ~460 KB). Enough for a tiny model to visibly learn, with nothing to download."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _read_documents(paths: list[str]) -> Iterator[str]:
    for p in paths:
        path = Path(p)
        if path.is_dir():
            raise SpecError(f"{p}", "is a directory; give the .txt/.jsonl files in it (e.g. DIR/*.jsonl)")
        if not path.is_file():
            raise SpecError("inputs", f"{p} not found")
        if path.suffix == ".jsonl":
            yield from _read_jsonl(p, path)
        else:
            try:
                text = path.read_text(encoding="utf-8-sig", errors="replace")
            except OSError as e:
                raise SpecError(f"{p}", f"cannot read it: {e.strerror or e}") from None
            yield text


def _read_jsonl(p: str, path: Path) -> Iterator[str]:
    n = 0
    try:
        with path.open(encoding="utf-8-sig") as f:  # a leading BOM (Windows editors) is dropped
            for n, line in enumerate(f, 1):  # noqa: B007 - n names the line in the error below
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, ValueError, RecursionError):
                    raise SpecError(f"{p}:{n}", "not a JSON line") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                    raise SpecError(f"{p}:{n}", "each JSON line needs a string 'text' field")
                try:
                    rec["text"].encode("utf-8")
                except UnicodeEncodeError:  # a "\ud800" escape: no UTF-8 bytes to tokenize
                    raise SpecError(f"{p}:{n}", "'text' holds an unpaired surrogate escape") from None
                yield rec["text"]
    except UnicodeDecodeError:
        raise SpecError(f"{p}", "not UTF-8 text (JSONL must be UTF-8)") from None
    except OSError as e:
        raise SpecError(f"{p}", f"cannot read it: {e.strerror or e}") from None


def pack(docs: Iterable[str], tok) -> Iterator[np.ndarray]:
    """Documents as token arrays, each followed by EOS (sequence packing: windows cross boundaries)."""
    eos = np.array([tok.eos_id], dtype=np.uint32)
    for d in docs:
        yield np.concatenate([tok.encode(d), eos])


def prepare(inputs: list[str], output: str, *, tokenizer: str = "byte", force: bool = False) -> Path:
    """Tokenize text/jsonl files into a shard directory, atomically (temp dir, then rename)."""
    from tqdm import tqdm

    out = Path(output).resolve()
    tok = globals()["tokenizer"](tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    files: list[list] = []
    n_docs = 0
    with atomic_dir(out, force=force) as tmp:
        buf: list[np.ndarray] = []
        buffered = 0

        def flush() -> None:
            nonlocal buf, buffered
            if not buffered:
                return
            name = f"tokens-{len(files):05d}.bin"
            np.concatenate(buf).astype(dtype).tofile(tmp / name)
            files.append([name, buffered])
            buf, buffered = [], 0

        total = sum(Path(p).stat().st_size for p in inputs if Path(p).is_file())
        with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=None) as bar:
            for doc in _read_documents(inputs):
                ids = next(pack([doc], tok))
                buf.append(ids)
                buffered += len(ids)
                n_docs += 1
                bar.update(len(doc.encode("utf-8", errors="replace")))
                if buffered >= SHARD_TOKENS:
                    flush()
            flush()
        if not files:
            raise SpecError("inputs", "no documents found")
        index = {
            "format": FORMAT,
            "dtype": np.dtype(dtype).name,
            "files": files,
            "tokenizer": tok.name,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "documents": n_docs,
        }
        (tmp / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    print(f"wrote {out}: {n_docs} documents, {sum(n for _, n in files)} tokens, tokenizer {tok.name}")
    return out


# --------------------------------------------------------------------------- reading and sampling


@dataclass
class TokenData:
    tokens: np.ndarray  # one flat stream (memmap for shard dirs)
    vocab_size: int
    source: str

    @classmethod
    def open(cls, path: str | None) -> TokenData:
        if path is None:
            tok = ByteTokenizer()
            stream = np.concatenate(list(pack(embedded_corpus(), tok))).astype(np.uint16)
            return cls(stream, tok.vocab_size, "embedded corpus (pydoc_data, byte tokenizer)")
        d = Path(path)
        idx = d / "index.json"
        if not idx.is_file():
            raise SpecError("data.path", f"{idx} not found; create shards with `dskit data prepare`")
        try:
            meta = json.loads(idx.read_text())
            parts = []
            for name, n in meta["files"]:
                f = d / name
                if not f.is_file() or f.stat().st_size != n * np.dtype(meta["dtype"]).itemsize:
                    raise SpecError("data.path", f"{f} is missing or truncated (expected {n} tokens)")
                parts.append(np.memmap(f, dtype=meta["dtype"], mode="r"))
        except (KeyError, ValueError, TypeError) as e:
            raise SpecError("data.path", f"{idx} is not a dskit shard index: {e}") from None
        stream = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return cls(stream, int(meta["vocab_size"]), str(d))


class Sampler:
    """Windows of seq_len+1 tokens, in a seeded permutation per epoch, addressed by global sample number.

    Sample g of the run is window perm_e[g mod W] with e = g // W: any rank can compute its samples for
    any step without state, so resume is exact and ranks never overlap.
    """

    def __init__(self, data: TokenData, seq_len: int, seed: int):
        self.data, self.seq_len, self.seed = data, seq_len, seed
        self.windows = (len(data.tokens) - 1) // seq_len
        if self.windows < 1:
            raise SpecError(
                "data.path",
                f"{data.source} has {len(data.tokens)} tokens, fewer than seq_len+1 ({seq_len + 1})",
            )
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _window(self, g: int) -> int:
        epoch, i = divmod(g, self.windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._perm_epoch = epoch
        return int(self._perm[i])

    def batch(self, first_sample: int, n: int) -> np.ndarray:
        """[n, seq_len + 1] int64 token windows for global samples first_sample .. first_sample + n - 1."""
        out = np.empty((n, self.seq_len + 1), dtype=np.int64)
        for j in range(n):
            s = self._window(first_sample + j) * self.seq_len
            out[j] = self.data.tokens[s : s + self.seq_len + 1]
        return out


def sample_index(step: int, micro: int, rank: int, *, grad_accum: int, world: int, micro_batch: int) -> int:
    """Global number of the first sample of (optimizer step, micro step, rank)."""
    return ((step * grad_accum + micro) * world + rank) * micro_batch
