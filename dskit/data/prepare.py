"""`dskit data prepare`: inputs -> a shard directory (format 2, `shards`), atomically. Offline only:
the trainer reads what this writes and never imports it (tests/test_layers.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from dskit.data import tokenizers
from dskit.data.encode import encoded
from dskit.data.readers import has_messages, records
from dskit.data.shards import EVAL_DIR, ShardWriter
from dskit.errors import SpecError
from dskit.io.atomic import atomic_dir


def held_out(doc: int, fraction: float) -> bool:
    """Whether document number `doc` (input order) belongs to the eval split: a hash of the number, so
    the split is the same whatever the process count or the corpus size, and about `fraction` of it."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(doc.to_bytes(8, "little"), digest_size=8).digest(), "little")
    return h < fraction * 2**64


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
    tok = tokenizers.tokenizer(tokenizer)  # the parameter names the spec, not the function
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    # The kind must be known before the first shard is written (text shards carry no mask): one cheap
    # pass over the JSON lines decides it.
    chat = has_messages(inputs, text_field)
    with atomic_dir(out, kind="data", force=force) as tmp:
        train, held = ShardWriter(tmp, dtype, chat), ShardWriter(tmp / EVAL_DIR, dtype, chat)
        total = sum(Path(p).stat().st_size for p in inputs if Path(p).is_file())
        with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=None) as bar:
            n = 0
            for batch in encoded(records(inputs, text_field), tok, tokenizer, workers):
                for ids, mask, size in batch:
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
