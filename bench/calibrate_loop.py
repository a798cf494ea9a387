"""GPU benchmark of the loop a user runs on their own machine: `dskit calibrate local --candidates N` at each
shape, which measures the hardware, plans with that calibration, and trains the calibrated plan's top N
candidates a few steps each (dskit/calibrate/candidates.py). Prints one table of every candidate's predicted
and measured tokens/s and peak memory, the errors beside them, and writes JSON: the evidence that, after
calibrating, each candidate is within 10% in tokens/s and memory (docs/planner.md "Calibrating your cluster").

    python3 bench/calibrate_loop.py --gpu h100-80gb --shape "1024 1" --shape "8192 1" --out $OUT/h100-calibrate-loop-DATE.json --work /tmp/cl

A shape is "SEQ GLOBAL_BATCH" (one GPU: the global batch bounds the micro-batch) of DeepSeek-V2-Lite at
--layers layers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import runs  # noqa: E402

#: the calibrated plan's goal on one GPU: every candidate's tokens/s and memory within this of the prediction
BAND = 0.10


def spec_sets(layers: int, seq: int, batch: int, cpus: int) -> list[str]:
    """The spec values a shape's calibration and its candidates ran with (besides the GPU, one per node)."""
    return [
        f"model.num_layers={layers}",
        f"training.seq_len={seq}",
        f"training.global_batch={batch}",
        f"hardware.cpus_per_node={cpus}",
    ]


def calibrate(seq: int, batch: int, a: argparse.Namespace) -> dict:
    """One `dskit calibrate local` at a shape; its candidates' records, or the failure's tail."""
    name = f"loop-s{seq}-gb{batch}"
    out_dir = a.work / name
    sets = spec_sets(a.layers, seq, batch, os.cpu_count() or 1)
    cmd = [
        sys.executable, "-m", "dskit", "calibrate", "local",
        "--gpu", a.gpu, "--gpus-per-node", "1", "--runtime", "none",
        "--set", f"runtime.python={sys.executable}",
        *(x for v in sets for x in ("--set", v)),
        "--set", f"storage.root={out_dir}/root",
        "--job-name", name, "--candidates", str(a.candidates),
        "-o", str(out_dir / "run"), "--force",
    ]  # fmt: skip
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    row = {"seq": seq, "global_batch": batch, "layers": a.layers, "sets": sets}
    row["wall_s"] = round(time.monotonic() - t0, 1)
    said = [
        x.split(": ", 1)[1] for x in p.stdout.splitlines() if x.startswith(("calibration: ", "candidates: "))
    ]
    if p.returncode != 0 or len(said) != 2:
        row["error"] = f"exit {p.returncode}: " + (p.stdout + p.stderr)[-3000:]
        return row
    report, cal = (Path(x.strip()) for x in said)  # the command prints candidates: then calibration:
    row["candidates"] = json.loads(report.read_text())["candidates"]
    row["calibration"] = json.loads(cal.read_text())
    row["plan_line"] = p.stdout.strip().splitlines()[-1]
    for c in row["candidates"]:
        if c["predicted_tokens_per_s"]:
            c["speed_error"] = round(c["predicted_tokens_per_s"] / c["measured_tokens_per_s"] - 1, 4)
        c["memory_error"] = round(c["predicted_gib"] / c["measured_peak_gib"] - 1, 4)
    return row


def derived(files: list[Path]) -> list[dict]:
    """Every measured candidate of these result files, with what re-predicting it needs: the spec values
    (`sets`: files written before rows recorded them ran with the machine's cores, which the calibration's
    CPU Adam probe used, one rank a node), the GPU profile and the calibration as written."""
    out = []
    for f in files:
        for r in json.loads(Path(f).read_text())["rows"]:
            cal = r.get("calibration")
            if cal is None:  # a failed shape: nothing measured
                continue
            adam = cal["cpu_adam"]
            sets = r.get("sets") or spec_sets(
                r["layers"], r["seq"], r["global_batch"], adam["threads_per_rank"] * adam["ranks"]
            )
            for c in r["candidates"]:
                out.append(
                    {"source": str(f), "gpu": cal["hardware"]["gpu"], "sets": sets, "calibration": cal, **c}
                )
    return out


def lines(row: dict) -> list[str]:
    shape = f"seq {row['seq']:5d} gb {row['global_batch']:3d}"
    if "error" in row:
        return [f"{shape}  FAILED {row['error'][-400:]}"]
    out = []
    for c in row["candidates"]:
        pred = c["predicted_tokens_per_s"] or 0
        speed = f"{c['speed_error']:+.1%}" if "speed_error" in c else "-"
        out.append(
            f"{shape}  {c['candidate'][:62]:62s} {pred:>8,} {c['measured_tokens_per_s']:>8,} {speed:>7s}"
            f"  {c['predicted_gib']:6.1f} {c['measured_peak_gib']:6.1f} {c['memory_error']:+.1%}"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", required=True, help='"SEQ GLOBAL_BATCH" (repeatable)')
    ap.add_argument("--gpu", required=True, help="the GPU's catalog profile (h100-80gb, h200-141gb)")
    ap.add_argument("--layers", type=int, default=4, choices=range(1, 61), metavar="1..60")
    ap.add_argument("--candidates", type=int, default=2, choices=range(1, 33), metavar="1..32")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    a = ap.parse_args()
    shapes = []
    for s in a.shape:
        try:
            seq, batch = (int(x) for x in s.split())
        except ValueError:
            ap.error(f"--shape {s!r}: expected two integers, SEQ GLOBAL_BATCH")
        if seq < 1 or batch < 1:
            ap.error(f"--shape {s!r}: SEQ and GLOBAL_BATCH must be positive")
        shapes.append((seq, batch))
    result = {**runs.header(), "band": BAND, "rows": []}
    print(
        f"{'shape':18s}  {'candidate':62s} {'pred':>8s} {'measured':>8s} {'error':>7s}  {'GiB':>6s} {'peak':>6s}"
    )
    for seq, batch in shapes:
        row = calibrate(seq, batch, a)
        result["rows"].append(row)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print("\n".join(lines(row)), flush=True)
    outside = [
        (r["seq"], r["global_batch"], c["candidate"])
        for r in result["rows"]
        for c in r.get("candidates", [])
        if abs(c.get("speed_error", 0)) > BAND or abs(c["memory_error"]) > BAND
    ]
    print(
        f"outside {BAND:.0%}: {outside or 'none'}; failed shapes: {[r['seq'] for r in result['rows'] if 'error' in r]}"
    )


if __name__ == "__main__":
    main()
