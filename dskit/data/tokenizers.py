"""Tokenizers: the built-in byte tokenizer and a local Hugging Face tokenizer directory."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from dskit.errors import SpecError


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


def pack(docs: Iterable[str], tok) -> Iterator[np.ndarray]:
    """Documents as token arrays, each followed by EOS (sequence packing: windows cross boundaries)."""
    eos = np.array([tok.eos_id], dtype=np.uint32)
    for d in docs:
        yield np.concatenate([tok.encode(d), eos])
