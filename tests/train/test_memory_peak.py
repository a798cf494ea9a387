"""bench/memsnap's replay of the allocator's history: the peak it reports is the one torch's statistics
keep, and the allocations live at it are grouped by the code that made them. The replay is the bench
script's, imported (what its `--analyse TRACE.json --start N` prints)."""

from __future__ import annotations

import json

from bench.memsnap import sitecustomize


class _Memsnap:
    """bench/memsnap/sitecustomize.py's `analyse`, imported; its result through JSON, as `--analyse`
    prints it."""

    @staticmethod
    def analyse(trace: list[dict], start: int) -> dict | None:
        return json.loads(json.dumps(sitecustomize.analyse(trace, start)))


def _memsnap() -> _Memsnap:
    return _Memsnap()


DS = [{"filename": "/x/site-packages/deepspeed/runtime/zero/stage_1_and_2.py", "line": 2192, "name": "copy"}]
LOOP = [{"filename": "/repo/dskit/train/loop.py", "line": 10, "name": "step"}]
GIB = 2**30


def _alloc(addr, gib, frames=()):
    return {"action": "alloc", "addr": addr, "size": int(gib * GIB), "frames": list(frames)}


def _free(addr, gib, completed=True):
    action = "free_completed" if completed else "free_requested"
    return {"action": action, "addr": addr, "size": int(gib * GIB), "frames": []}


def test_the_peak_is_after_the_mark_and_counts_a_requested_free_as_free():
    m = _memsnap()
    trace = [
        _alloc(1, 10, LOOP),  # construction: a peak before training starts
        _free(1, 10),
        _alloc(2, 2, DS),  # training starts at index 2
        _alloc(3, 3, LOOP),
        _free(3, 3, completed=False),  # torch's statistics drop it here, not at free_completed
        _alloc(4, 4),  # autograd's own allocation: no Python frames
        _free(3, 3),
    ]
    r = m.analyse(trace, start=2)
    assert r["peak_allocated_gib"] == 6.0  # 2 + 4, the 3 GiB already freed
    assert r["peak_event"]["context"] == "/repo/dskit/train/loop.py:10:step"  # the last Python-made event
    sites = {x["site"]: x["gib"] for x in r["live_at_peak"]}
    assert sites == {"deepspeed/runtime/zero/stage_1_and_2.py:2192:copy": 2.0, "": 4.0}


def test_reserved_follows_segments_and_expandable_mappings():
    m = _memsnap()
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 8 * GIB},
        {"action": "segment_map", "addr": 0, "size": 4 * GIB},
        _alloc(1, 5, DS),
        {"action": "segment_unmap", "addr": 0, "size": 4 * GIB},
    ]
    r = m.analyse(trace, start=0)
    assert r["reserved_at_peak_gib"] == 12.0 and r["peak_reserved_gib"] == 12.0


def test_a_process_that_allocated_nothing_after_the_mark_reports_nothing():
    m = _memsnap()
    assert m.analyse([], start=0) is None
    assert m.analyse([_alloc(1, 2, DS), _free(1, 2)], start=2) is None
