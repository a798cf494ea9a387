"""docs/support.md's GPU rows beside torchtitan, generated from the newest peer results (bench/peer_bench.py
writes them to bench/results/peer/): one sentence per GPU (`GPUS`), each from that GPU's calls only; for
each shape, the newest call that measured the plan's own config (the `dskit` row, no `--set`) beside
torchtitan; profiled calls are left out (the profiler slows both sides). tests/test_docs.py fails when a
sentence differs from what this writes.

    python -m tests.support.peer_row           # print the generated sentence
    python -m tests.support.peer_row --write   # put it into docs/support.md, between the markers
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PEER = REPO / "bench" / "results" / "peer"
SUPPORT = REPO / "docs" / "support.md"
#: the GPUs with a sentence of their own: a result counts for the GPU its `hardware` line names
GPUS = ("H200", "H100")
END = "<!-- /peer_row -->"


def begin(gpu: str) -> str:
    return f"<!-- peer_row {gpu}: python -m tests.support.peer_row --write -->"


def _span(gpu: str) -> re.Pattern:
    return re.compile(re.escape(begin(gpu)) + ".*?" + re.escape(END), re.S)


def _key(row: dict) -> tuple[int, int, int, int]:
    return row["layers"], row["seq_len"], row["global_batch"], row["micro_batch"] or row["global_batch"]


def newest(results: dict[str, dict], gpu: str) -> dict[tuple, dict]:
    """shape -> the newest call's {file, date, dskit, torchtitan, variants} among `results` (file name ->
    its JSON) measured on `gpu`, per the rule above."""
    found: dict[tuple, dict] = {}
    for name, res in results.items():
        on = re.search(rf"\bNVIDIA {gpu}\b", " ".join(res.get("hardware", [])))
        if "--profile" in res.get("command", "") or not on:
            continue
        rows = res.get("rows", [])
        peer = {_key(r): r for r in rows if r.get("system") == "torchtitan" and r.get("tok_s_gpu")}
        for r in rows:
            k = _key(r)
            plain = r.get("system") == "dskit" and not r.get("sets") and r.get("tok_s_gpu")
            if not plain or k not in peer or (k in found and found[k]["date"] >= res["date"]):
                continue
            variants = [
                v
                for v in rows
                if v.get("system", "").startswith("dskit, ") and _key(v) == k and v.get("tok_s_gpu")
            ]
            found[k] = {
                "file": name,
                "date": res["date"],
                "dskit": r,
                "torchtitan": peer[k],
                "variants": variants,
            }
    return found


def _shape(k: tuple, label: str, before: tuple | None, layered: bool) -> str:
    """'seq 4096 micro-batch 2' ('8 layers seq 4096 ...' where the shapes differ in depth), or 'micro-batch 2'
    after a shape of the same depth and sequence length; a batch the call named by its global size
    (peer_bench's `gb16`) keeps that name."""
    layers, seq, gb, mb = k
    batch = f"global batch {gb}" if gb != mb or label.endswith(f"gb{gb}") else f"micro-batch {mb}"
    if before and before[:2] == (layers, seq):
        return batch
    return f"{f'{layers} layers ' if layered else ''}seq {seq} {batch}"


def sentence(found: dict[tuple, dict]) -> str:
    """The generated part of the row: how dskit's tokens/s compares, shape by shape, and where from."""
    parts, ratios, less_memory, before = [], [], 0, None
    for k in sorted(found):
        f = found[k]
        tt = f["torchtitan"]["tok_s_gpu"]
        ratio = f["dskit"]["tok_s_gpu"] / tt
        ratios.append(ratio)
        less_memory += f["dskit"]["peak_gib"] < f["torchtitan"]["peak_gib"]
        extra = "".join(
            f" ({v['tok_s_gpu'] / tt:.2f}x with {v['system'].removeprefix('dskit, ')})" for v in f["variants"]
        )
        parts.append(
            f"{_shape(k, f['dskit']['shape'], before, len({x[0] for x in found}) > 1)} {ratio:.2f}x{extra}"
        )
        before = k
    lo, hi = min(ratios), max(ratios)
    verdict = "ahead of it" if lo > 1 else "behind it" if hi < 1 else "from behind to ahead of it"
    files = sorted({f["file"] for f in found.values()})
    dates = sorted({f["date"][:10] for f in found.values()})
    return (
        f"{verdict} in tokens/s in the newest run of each shape ({lo:.2f}-{hi:.2f}x), at less peak memory "
        f"at {less_memory} of {len(found)}: {', '.join(parts)} (layers {'/'.join(sorted({str(k[0]) for k in found}))}; "
        f"bench/results/peer/{{{','.join(files)}}}, {' to '.join(dict.fromkeys([dates[0], dates[-1]]))})"
    )


def results(folder: Path = PEER) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def render(doc: str, gpu: str, found: dict[tuple, dict]) -> str:
    """`doc` with the span between `gpu`'s markers replaced by the generated sentence."""
    span = _span(gpu)
    assert len(span.findall(doc)) == 1, f"docs/support.md needs one {begin(gpu)} ... {END} span"
    return span.sub(lambda _: f"{begin(gpu)}{sentence(found)}{END}", doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite docs/support.md's generated span")
    a = ap.parse_args()
    doc = SUPPORT.read_text()
    for gpu in GPUS:
        found = newest(results(), gpu)
        doc = render(doc, gpu, found)
        if not a.write:
            print(f"{gpu}: {sentence(found)}")
    if a.write:
        SUPPORT.write_text(doc)


if __name__ == "__main__":
    main()
