"""What holds a GPU's memory at its training peak: loaded into every trainer process by
bench/memory_peak.py (PYTHONPATH), active only where DSKIT_MEMSNAP_OUT names a folder.

Records the CUDA caching allocator's history (torch.cuda.memory._record_memory_history, Python stacks)
from the first import on, marks the point where the trainer resets its peak statistics (the start of
training: dskit/train/metrics.py), and at exit replays the alloc/free events after that mark to find
the peak of allocated bytes. Writes OUT/rank{RANK}.json: the peak, the reserved bytes then and at
their own peak, and the live allocations at the peak grouped by where they were made.

Run as a program it replays a trace (a JSON list of the allocator's events) and prints `analyse`'s
result as JSON; tests/train/test_memory_peak.py imports `analyse` (bench.memsnap.sitecustomize).

    python bench/memsnap/sitecustomize.py --analyse TRACE.json --start N
"""

from __future__ import annotations

import atexit
import json
import os

OUT = os.environ.get("DSKIT_MEMSNAP_OUT")
#: frames from these packages name an allocation's site; the first (innermost) that matches is its key
SITES = ("/dskit/", "/deepspeed/", "/transformers/", "/peft/", "/torch/optim/", "/torch/_dynamo/")
GIB = 2**30
MAX_ENTRIES = 4_000_000
#: the allocator's statistics count a block free when it is asked for (a block another stream still
#: uses is reusable only later, at free_completed): so does the replay, to meet max_memory_allocated
FREES = ("free_requested", "free_completed")
#: reserved memory: cudaMalloc'd segments, or with expandable segments (the launch contract's
#: PYTORCH_CUDA_ALLOC_CONF) pages mapped into them
GROWS = ("segment_alloc", "segment_map")
SHRINKS = ("segment_free", "segment_unmap")


def _site(frames: list[dict]) -> str:
    own = [f for f in frames if any(s in f.get("filename", "") for s in SITES)]
    pick = own[:3] if own else frames[:2]
    return " < ".join(f"{f['filename'].split('site-packages/')[-1]}:{f['line']}:{f['name']}" for f in pick)


def analyse(trace: list[dict], start: int) -> dict | None:
    """Peak of allocated bytes over trace[start:], with the allocations live at it grouped by site;
    None where nothing was allocated there."""
    sizes: dict[int, int] = {}
    allocated = reserved = 0
    peak = peak_at = peak_reserved = reserved_at_peak = 0
    for i, e in enumerate(trace):
        a = e["action"]
        if a == "alloc":
            sizes[e["addr"]] = e["size"]
            allocated += e["size"]
        elif a in FREES and e["addr"] in sizes:
            allocated -= sizes.pop(e["addr"])
        elif a in GROWS:
            reserved += e["size"]
        elif a in SHRINKS:
            reserved -= e["size"]
        if i >= start:
            peak_reserved = max(peak_reserved, reserved)
            if allocated > peak:
                peak, peak_at, reserved_at_peak = allocated, i, reserved
    if peak == 0:
        return None
    # replay to the peak again, keeping the live set there
    live: dict[int, tuple[int, str]] = {}
    for e in trace[: peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames", [])))
        elif e["action"] in FREES:
            live.pop(e["addr"], None)
    # where the program was at the peak: the nearest event before it made from Python (the autograd
    # engine's allocations carry no Python frames)
    context = next((_site(e["frames"]) for e in reversed(trace[: peak_at + 1]) if e.get("frames")), "")
    by_site: dict[str, list[float]] = {}
    for size, site in live.values():
        s = by_site.setdefault(site, [0.0, 0])
        s[0] += size / GIB
        s[1] += 1
    top = sorted(by_site.items(), key=lambda kv: -kv[1][0])
    return {
        "events": len(trace),
        "training_from_event": start,
        "peak_allocated_gib": round(peak / GIB, 3),
        "reserved_at_peak_gib": round(reserved_at_peak / GIB, 3),
        "peak_reserved_gib": round(peak_reserved / GIB, 3),
        "peak_event": {k: trace[peak_at].get(k) for k in ("action", "size")}
        | {"site": _site(trace[peak_at].get("frames", [])), "context": context},
        "live_at_peak": [{"gib": round(g, 3), "count": n, "site": site} for site, (g, n) in top[:40]],
    }


def _install() -> None:
    import torch

    if not torch.cuda.is_available():
        return
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    mark = {"at": 0}
    reset = torch.cuda.reset_peak_memory_stats

    def marked_reset(device=None):
        mark["at"] = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
        return reset(device)

    torch.cuda.reset_peak_memory_stats = marked_reset

    def dump() -> None:
        if not torch.cuda.is_initialized():  # a launcher or compile worker: it never used the GPU
            return
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        if len(trace) >= MAX_ENTRIES:  # the ring wrapped: the mark and the early blocks are gone
            raise SystemExit(f"memsnap: over {MAX_ENTRIES} allocator events; record fewer steps")
        result = analyse(trace, mark["at"])
        if result is None:
            return
        result["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        result["max_memory_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
        os.makedirs(OUT, exist_ok=True)
        name = f"rank{os.environ.get('RANK', '0')}-pid{os.getpid()}.json"  # every process writes its own
        with open(os.path.join(OUT, name), "w") as f:
            json.dump(result, f, indent=1)

    atexit.register(dump)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--analyse", type=open, required=True, metavar="TRACE.json", help="the events, a JSON list"
    )
    ap.add_argument("--start", type=int, default=0, help="the index of the mark (the start of training)")
    a = ap.parse_args()
    print(json.dumps(analyse(json.load(a.analyse), a.start)))


if OUT:
    _install()
elif __name__ == "__main__":
    main()
