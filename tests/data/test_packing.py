"""Packing whole chat samples into rows: rows of a long-tailed chat set are at least
97% full, and the rows stay a function of the seed, so a resumed run and a mixture read exactly what an
uninterrupted one does."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dskit.data import IGNORE_INDEX
from dskit.data.sampler import DataPosition, Mixture, Sampler
from dskit.data.shards import TokenData
from tests.support.chat_data import (
    LONG_TAIL_CHATS,
    LONG_TAIL_MAX,
    epoch_packing_efficiency,
    write_long_tail_shards,
)


@pytest.fixture(scope="module")
def long_tail(tmp_path_factory) -> TokenData:
    return TokenData.open(str(write_long_tail_shards(tmp_path_factory.mktemp("chat") / "shards")))


def _chats(data: TokenData) -> list[np.ndarray]:
    return [
        np.asarray(s.tokens[a:b]) for s in data.shards for a, b in zip([0, *s.ends[:-1]], s.ends, strict=True)
    ]


def test_the_generated_set_has_the_issues_shape(long_tail):
    """9,000 chats of 1-3 turns (each turn ends in EOS), 214 tokens on average, long-tailed to 1,800."""
    chats = _chats(long_tail)
    sizes = np.asarray([len(c) for c in chats])
    turns = Counter(int((c == long_tail.eos_id).sum()) for c in chats)
    assert len(chats) == LONG_TAIL_CHATS and set(turns) == {1, 2, 3}
    assert 200 <= sizes.mean() <= 230 and sizes.max() == LONG_TAIL_MAX and np.median(sizes) < 160


@pytest.mark.parametrize("seq_len", [2048, 4096])
def test_long_tailed_chat_rows_are_at_least_97_percent_full(long_tail, seq_len):
    """The issue measured 0.90 at seq 2048 and 0.95 at 4096 with rows closed at the first sample that
    did not fit; best fit over a window of the seeded order fills them to 97% or more."""
    assert epoch_packing_efficiency(Sampler(long_tail, seq_len, seed=0)) >= 0.97
    from dskit.data.packing import next_fit  # the packer the issue measured: this set reproduces it

    assert epoch_packing_efficiency(Sampler(long_tail, seq_len, seed=0, packer=next_fit)) < 0.95


def test_every_sample_is_in_one_row_whole_once_an_epoch(long_tail):
    sampler = Sampler(long_tail, 2048, seed=7)
    seen: Counter = Counter()
    for g in range(sampler.windows):
        b = sampler.get(g, 1)
        pos, inp, lab = b.position_ids[0], b.input_ids[0], b.labels[0]
        starts = [*np.flatnonzero(pos == 0).tolist(), len(pos)]
        for a, e in zip(starts, starts[1:], strict=False):
            if (lab[a:e] == IGNORE_INDEX).all():
                continue  # the padding at the row's end
            seen[(*inp[a:e], lab[e - 1])] += 1  # its inputs, then its last label (the EOS)
    chats = Counter(tuple(c.tolist()) for c in _chats(long_tail))
    assert seen == chats


def test_a_restarted_run_reads_the_rows_the_uninterrupted_run_read(long_tail):
    """A restart builds its Sampler afresh and continues at the checkpoint's sample count: its
    micro-batches for every step after the checkpoint, through the next epoch, are the uninterrupted
    run's, at the same global batch and at another (a resume on more nodes)."""
    world, micro, accum = 2, 4, 2
    batch = world * micro * accum
    run = Sampler(long_tail, 2048, seed=5)
    steps = run.windows // batch + 3  # past the epoch's end: the next epoch's order too

    def rows(sampler: Sampler, position: DataPosition, step: int, rank: int, m: int) -> np.ndarray:
        first = position.micro_batch_start(step, m, rank, grad_accum=accum, world=world, micro_batch=micro)
        b = sampler.get(first, micro)
        return np.stack([b.input_ids, b.labels, b.position_ids])

    start = DataPosition(0, 0, batch)
    ckpt = 11
    resumed, at = Sampler(long_tail, 2048, seed=5), DataPosition(ckpt, start.first(ckpt), batch)
    for step in range(ckpt, steps):
        for rank in range(world):
            for m in range(accum):
                assert (rows(run, start, step, rank, m) == rows(resumed, at, step, rank, m)).all()
    # on another world size the run continues at the next unseen sample: the same sequence of rows
    wider = DataPosition(ckpt, start.first(ckpt), 2 * batch)
    assert (
        Sampler(long_tail, 2048, seed=5).get(wider.first(ckpt + 1), micro).input_ids
        == run.get(start.first(ckpt + 2), micro).input_ids
    ).all()
    other = Sampler(long_tail, 2048, seed=6)
    assert not (other.get(0, micro).input_ids == run.get(0, micro).input_ids).all()  # a seed's own order


def test_a_mixture_of_packed_chat_sources_takes_exact_shares_of_their_rows(tmp_path):
    """Each block of Mixture.BLOCK rows takes exactly each source's share, every row one of its source's
    packed rows; a restarted run's mixture reads from any sample what the uninterrupted one did."""
    sources = [
        TokenData.open(str(write_long_tail_shards(tmp_path / name, n=1500, seed=seed)))
        for name, seed in (("a", 1), ("b", 2))
    ]

    def mixture() -> Mixture:
        return Mixture([Sampler(d, 2048, seed=3) for d in sources], [3.0, 1.0], seed=3)

    mix = mixture()
    own = [{s.get(g, 1).input_ids.tobytes(): i for g in range(s.windows)} for i, s in enumerate(mix.samplers)]
    rows = mix.get(0, 4 * Mixture.BLOCK)
    source = [next(i for i, o in enumerate(own) if r.tobytes() in o) for r in rows.input_ids]
    for block in range(4):
        counts = Counter(source[block * Mixture.BLOCK : (block + 1) * Mixture.BLOCK])
        assert [counts[0], counts[1]] == [768, 256] == mix.per_block.tolist()
    for s in mix.samplers:
        assert epoch_packing_efficiency(s) >= 0.97
    again = mixture().get(2500, 8)
    assert (again.input_ids == rows.input_ids[2500:2508]).all()
    assert (again.labels == rows.labels[2500:2508]).all()


def test_packing_is_built_once_from_the_seed_not_from_what_was_read(long_tail):
    """The rows are fixed when the Sampler is made: reading in any order gives each sample number the
    same row (no loader state that a checkpoint would have to save)."""
    a, b = Sampler(long_tail, 2048, seed=9), Sampler(long_tail, 2048, seed=9)
    forward = [a.get(g, 1).input_ids for g in range(0, 300, 7)]
    backward = [b.get(g, 1).input_ids for g in reversed(range(0, 300, 7))][::-1]
    assert all((x == y).all() for x, y in zip(forward, backward, strict=True))


@pytest.mark.parametrize(
    "need, seq_len",
    [
        (np.random.default_rng(0).integers(1, 257, 5000), 256),  # many longer than half a row
        (np.random.default_rng(1).integers(1, 9, 3000), 8),  # rows of a few slots
        (np.full(500, 64), 64),  # every sample a whole row
        (np.asarray([5]), 2048),  # one sample
        (np.zeros(0, dtype=np.int64), 2048),  # none
    ],
)
def test_best_fit_rows_hold_every_sample_once_within_seq_len_and_no_more_rows_than_before(need, seq_len):
    from dskit.data.packing import best_fit, next_fit

    order, first = best_fit(need, seq_len)
    assert sorted(order.tolist()) == list(range(len(need))) and first[0] == 0 and first[-1] == len(need)
    rows = [order[a:b] for a, b in zip(first[:-1], first[1:], strict=True)]
    assert all(len(r) and need[r].sum() <= seq_len and (np.diff(r) > 0).all() for r in rows)
    assert len(rows) <= len(next_fit(need, seq_len)[1]) - 1
    again = best_fit(need.copy(), seq_len)
    assert (again[0] == order).all() and (again[1] == first).all()
