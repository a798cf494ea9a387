"""Records -> (tokens, loss mask) in input order: in this process, or in a bounded pool of them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dskit.data.chat import encode_chat
from dskit.data.tokenizers import pack, tokenizer

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


def encoded(records: Iterator, tok, spec: str, workers: int) -> Iterator[list]:
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
