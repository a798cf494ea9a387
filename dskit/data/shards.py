"""The shard format: a prepared directory, written by `ShardWriter` and read by `TokenData.open`.

Shard directory layout (format 2):
    index.json     {"format": 2, "kind": "text"|"chat", "dtype": "uint16"|"uint32",
                    "files": [[stem, n_tokens, n_documents], ...], "tokenizer": "byte" | path,
                    "tokenizer_fingerprint": str, "vocab_size": int, "eos_id": int, "documents": int}
    tokens-00000.bin   flat token stream (documents back to back; text documents end with EOS)
    docs-00000.bin     uint64: the end offset of each document in the stream (sample boundaries)
    mask-00000.bin     (chat only) uint8 per token: 1 where the token is a training target (assistant
                       turns), 0 where it is context only (system/user turns, the template's markup)
    eval/              (`--eval-fraction`) the held-out split, in the same layout
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dskit.data.corpus import embedded_corpus
from dskit.data.tokenizers import ByteTokenizer, pack
from dskit.errors import SpecError

FORMAT = 2  # 1: tokens only (no document ends, no loss mask); refused with a re-prepare hint
SHARD_TOKENS = 1 << 28  # 256M tokens (512 MiB in uint16) per file
EVAL_DIR = "eval"  # the held-out split inside a prepared dir (`--eval-fraction`)


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
