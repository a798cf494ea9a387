"""Which whole chat samples share a row of seq_len: `best_fit`, the packer `Sampler` uses.

Both packers here take the row slots each sample needs, in the run's seeded sample order, and return
the rows as (order, first): row r holds the samples order[first[r]:first[r+1]] (positions in the
input), each row's samples in the seeded order. Neither reads anything but its arguments, so the rows
are a function of (seed, data, seq_len) and a resumed run rebuilds exactly the rows it left.

`best_fit`: best-fit decreasing over a bounded window. Samples are taken in the seeded
order until they fill about WINDOW_ROWS rows; the window's samples, longest first, each go into the
open row with the least room that still holds it (a new row where none does). The window's least-full
row is not closed: its samples go back to the front of the next window, so rows are not cut short at
every window's end; the last window closes all. On a long-tailed chat set (9,000 chats, mean
214 tokens, tail to 1,800) an epoch's rows are 0.999 full at seq 2048 and 0.998 at 4096, against 0.888
and 0.940 for `next_fit` (bench/chat_bench.py --packing). The window keeps each row's samples from one
stretch of the seeded order (best fit over the whole set would end it with rows of nothing but the
shortest samples) and bounds the work per sample to a sort and a search of one window's open rows
(9,000 samples: 7 ms).

`next_fit`: the packer before best fit, the samples in the seeded order, a row closed at the first
sample that does not fit. The trainer never uses it; it stays so bench/chat_bench.py can show both
packers on the same data (`Sampler(..., packer=next_fit)`).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable

import numpy as np

#: a window is samples worth about this many rows. With the carried row its size matters little: at 64
#: both generated chat sets of bench/chat_bench.py pack into at most 3 rows more than best fit over the
#: whole set (at seq 2048 and 4096; at 4 rows, up to 24 more)
WINDOW_ROWS = 64

Packer = Callable[[np.ndarray, int], "tuple[np.ndarray, np.ndarray]"]


def best_fit(need: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of best-fit decreasing over windows of WINDOW_ROWS rows' worth of samples; `need[i]` is the
    row slots of sample i (1 .. seq_len), in the seeded order. Returns (order, first)."""
    need = np.asarray(need, dtype=np.int64)
    n, budget = len(need), WINDOW_ROWS * seq_len
    ends = np.cumsum(need)
    rows: list[list[int]] = []
    carried: list[int] = []
    at = 0
    while at < n:  # (samples are carried only while some are left to take)
        # the window: the carried samples, then the next ones in seeded order up to the budget
        took = int(ends[at - 1]) if at else 0
        stop = int(np.searchsorted(ends, took + budget - int(need[carried].sum()), side="left")) + 1
        stop = min(n, max(stop, at + 1))
        window = np.concatenate([np.asarray(carried, dtype=np.int64), np.arange(at, stop)])
        window = window[np.argsort(-need[window], kind="stable")]
        room: list[tuple[int, int]] = []  # (free slots, row), ascending: the open rows
        members: list[list[int]] = []
        for i in window.tolist():
            k = int(need[i])
            j = bisect_left(room, (k, -1))
            if j == len(room):
                members.append([i])
                free, r = seq_len - k, len(members) - 1
            else:
                free, r = room.pop(j)
                free -= k
                members[r].append(i)
            insort(room, (free, r))
        at = stop
        carried = []
        if at < n:  # room is ascending: its last row is the least full
            carried = members[room[-1][1]]
            members[room[-1][1]] = []
        rows += [sorted(m) for m in members if m]
    return _rows(rows)


def next_fit(need: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The packer before best fit (see the module's docstring): in the seeded order, a new row at the
    first sample that does not fit the current one. Returns (order, first)."""
    rows: list[list[int]] = []
    used = 0
    for i, k in enumerate(np.asarray(need, dtype=np.int64).tolist()):
        if not rows or used + k > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += k
    return _rows(rows)


def one_per_row(need: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """`packing: pad`: every sample a row of its own, in the seeded order. Returns (order, first)."""
    return np.arange(len(need), dtype=np.int64), np.arange(len(need) + 1, dtype=np.int64)


def _rows(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    order = np.asarray([i for r in rows for i in r], dtype=np.int64)
    first = np.cumsum([0, *(len(r) for r in rows)], dtype=np.int64)
    return order, first
