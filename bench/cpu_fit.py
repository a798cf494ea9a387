"""The CPU ranks' constants of dskit/plan/speed.py ("CPU ranks"), fitted on the machine this runs on (the
CPU reference machine of dskit/calibrate/scales.py; docs/planner.md "CPU ranks").

It calibrates this machine (`dskit calibrate local`, 2 ranks; three times, before, between and after
the runs, each probe taken at its median: `typical`), trains every candidate of a small grid on
2 CPU ranks for a few steps (tiny-v2 and tiny-v2-experts; ZeRO-2 and ZeRO-3; EP 1 and 2; micro-batch 1
and 4 of a per-rank batch of 4; a checkpointed pair), and fits the constants by least squares on the
relative step-time error, the calibrated terms (collectives, AutoEP's exchange, the optimizer) held as
the plan predicts them. The model is linear in what it fits: compute time at CPU_COMPUTE_TFLOPS (over the
host probe's ratio to the reference), and host seconds per layer pass (ZeRO-3; ZeRO-1/2), per MoE
layer pass at EP > 1 and per optimizer step (ZeRO-3; ZeRO-1/2).

    python bench/cpu_fit.py --out bench/results/cpu/cpu-fit-2026-12-05b.json    # measure (minutes), fit
    python bench/cpu_fit.py --check bench/results/cpu/cpu-fit-2026-12-05b.json  # refit the file's runs
    python bench/cpu_fit.py --refit bench/results/cpu/cpu-fit-2026-12-05b.json  # and write it back (the
                                                       # model changed): then set speed.py's constants

`--check` (tests/plan/test_cpu_plan.py) refits from the committed runs and their calibration, prints the
fit beside speed.py's constants, and exits 1 where they differ by more than the rounding they are kept
at (ROUND), or a run's prediction misses its measurement by more than TOLERANCE.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import runs  # noqa: E402
from dskit.io.atomic import write_file  # noqa: E402
from dskit.plan import speed  # noqa: E402

#: what is fitted, and the step each is kept at in speed.py
ROUND = {
    "CPU_COMPUTE_TFLOPS": 0.0005,
    "CPU_HOST_LAYER_PASS_S": 0.0005,
    "CPU_HOST_LAYER_PASS_UNHOOKED_S": 0.0005,
    "CPU_EP_LAYER_PASS_S": 0.0005,
    "CPU_HOST_OPTIMIZER_STEP_S": 0.0005,
    "CPU_HOST_OPTIMIZER_STEP_UNHOOKED_S": 0.0005,
}
#: a run's predicted step time against its measurement, after the fit
TOLERANCE = 0.15
MODELS = ("tiny-v2", "tiny-v2-experts")
SETS = ["training.seq_len=128", "training.global_batch=8", "training.log_every=1", "checkpoint.final=false"]
STEPS, WARMUP = 14, 4
GRID = [
    {"zero_stage": z, "ep_size": e, "micro_batch": m, "activation_checkpointing": 0}
    for z in (2, 3)
    for e in (1, 2)
    for m in (1, 4)
] + [
    {"zero_stage": 2, "ep_size": 2, "micro_batch": 4, "activation_checkpointing": 1},
    {"zero_stage": 3, "ep_size": 1, "micro_batch": 4, "activation_checkpointing": 1},
]


def dskit(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "dskit", *args], capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise SystemExit(f"dskit {' '.join(args)} -> {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def flags(model: str, root: Path, extra: list[str] = ()) -> list[str]:
    out = ["--gpu", "cpu", "--gpus-per-node", "2", "--model", model]
    for s in [*SETS, f"storage.root={root}", *extra]:
        out += ["--set", s]
    return out


def pins(c: dict) -> list[str]:
    return [f"overrides.{k}={v}" for k, v in c.items() if k != "activation_checkpointing"] + [
        f"overrides.activation_checkpointing={c['activation_checkpointing']}",
        "overrides.offload_optimizer=none",
    ]


def calibrate(root: Path) -> dict:
    """One local calibration (`dskit calibrate local`), as written."""
    dskit("calibrate", "local", *flags("tiny-v2-experts", root), "-o", str(root / "cal"), "--force")
    return json.loads(next(root.glob("*/outputs/calibration.json")).read_text())


def typical(cals: list[dict]) -> dict:
    """The first calibration with each probe at its median over all: this machine's speed moves over
    minutes (a VM among others: the GEMM probe read 0.58 and 1.03 TFLOP/s ten minutes apart, and the
    steps measured between did not follow it), and the constants are fitted against the probes' typical
    reading, the one a calibration on this machine most often gives."""
    out = json.loads(json.dumps(cals[0]))
    for probe in ("gemm_tflops", "host_layer_pass_s"):
        out["compute"][probe] = statistics.median(c["compute"][probe] for c in cals)
    out["cpu_adam"]["core_s_per_bparam"] = statistics.median(c["cpu_adam"]["core_s_per_bparam"] for c in cals)
    out["probe_readings"] = [{**c["compute"], "cpu_adam": c["cpu_adam"]["core_s_per_bparam"]} for c in cals]
    return out


def measure(root: Path) -> dict:
    cals = [calibrate(root)]  # before, between the models, after: the probes' typical reading
    rows = []
    for model in MODELS:
        for i, c in enumerate(GRID):
            rd = root / "run-dirs" / f"{model}-{i}"
            extra = [*pins(c), f"training.steps={STEPS}", f"checkpoint.every={STEPS + 1}"]
            dskit(
                "render",
                "slurm",
                *flags(model, root, extra),
                "--runtime",
                "none",
                "-o",
                str(rd),
                "--job-name",
                f"{model}-{i}",
            )
            dskit("train", "--local", str(rd))
            steps = [r["step_time_s"] for r in runs.step_records(rd) if r["step"] > WARMUP]
            rows.append({"model": model, "candidate": c, "measured_step_s": statistics.median(steps)})
            print(f"{model} {c}: {rows[-1]['measured_step_s']:.4f} s", flush=True)
        cals.append(calibrate(root))
    cal = typical(cals)
    return {**runs.header(), "probe_readings": cal.pop("probe_readings"), "calibration": cal, "rows": rows}


def terms(row: dict, cal_file: Path) -> tuple[float, list[float]]:
    """(the step's seconds the fit does not touch, the seconds each fitted constant contributes per unit),
    from today's plan of the row's candidate with the calibration."""
    from dskit.plan.build import build_plan_searched
    from dskit.spec import load_spec

    def step(**values: float) -> float:
        with runs.patched(speed, **values):
            sets = [*SETS, f"hardware.calibration={cal_file}", *pins(row["candidate"])]
            hw = {"hardware.gpu": "cpu", "hardware.gpus_per_node": 2, "model.preset": row["model"]}
            spec = load_spec(None, sets, hw)
            _, found = build_plan_searched(spec)
            return found.chosen.speed.step_s

    # the compute term is linear in 1 / rate: 1 TFLOP/s gives the unit; host terms in seconds each
    zero = {k: 0.0 for k in ROUND if k != "CPU_COMPUTE_TFLOPS"}
    base = step(**zero, CPU_COMPUTE_TFLOPS=1e12)
    units = [step(**zero, CPU_COMPUTE_TFLOPS=1.0) - base]
    for k in zero:
        units.append(step(**{**zero, k: 1.0}, CPU_COMPUTE_TFLOPS=1e12) - base)
    return base, units


def fit(data: dict) -> tuple[dict[str, float], list[dict]]:
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        cal_file = Path(tmp) / "calibration.json"
        cal_file.write_text(json.dumps(data["calibration"]))
        parts = [terms(r, cal_file) for r in data["rows"]]
    y = np.array([r["measured_step_s"] for r in data["rows"]])
    base = np.array([b for b, _ in parts])
    a = np.array([u for _, u in parts])
    # relative error: each row divided by its measurement; constants kept non-negative (drop and refit)
    free = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        x[free] = np.linalg.lstsq(a[:, free] / y[:, None], (y - base) / y, rcond=None)[0]
        neg = [i for i in free if x[i] < 0]
        if not neg:
            break
        free = [i for i in free if i not in neg]
    names = list(ROUND)
    if x[0] <= 0:  # compute explained nothing: no rate to write, and the runs say why
        raise SystemExit(
            "cpu_fit: the runs fit no compute term (its coefficient came out <= 0): measure again"
        )
    values = {"CPU_COMPUTE_TFLOPS": 1 / x[0]}
    values.update({n: float(v) for n, v in zip(names[1:], x[1:], strict=True)})
    fitted = {n: round(round(v / ROUND[n]) * ROUND[n], 6) for n, v in values.items()}
    units = np.array([1 / fitted["CPU_COMPUTE_TFLOPS"], *(fitted[n] for n in names[1:])])
    predicted = base + a @ units
    out = [
        {**r, "predicted_step_s": round(float(p), 4), "error": round(float(p / r["measured_step_s"] - 1), 3)}
        for r, p in zip(data["rows"], predicted, strict=True)
    ]
    return fitted, out


def committed_runs(path: Path) -> dict:
    """A committed file's runs and calibration, without the fit it was written with."""
    data = json.loads(path.read_text())
    data["rows"] = [{k: r[k] for k in ("model", "candidate", "measured_step_s")} for r in data["rows"]]
    return data


def _run(r: dict) -> str:
    return f"{r['model']} {r['candidate']}"


def compare(data: dict) -> tuple[dict, list[dict], list[str]]:
    """Refit `data`'s runs: the fitted constants, the runs with today's predictions, and what is off: each
    constant whose fit differs from speed.py's at its rounding, each run predicted beyond TOLERANCE
    (`--check`'s exit 1; tests/plan/test_cpu_plan.py)."""
    fitted, rows = fit(data)
    off = [
        name for name, value in fitted.items() if abs(getattr(speed, name) - value) > ROUND[name] / 2 + 1e-12
    ]
    off += [_run(r) for r in rows if abs(r["error"]) > TOLERANCE]
    return fitted, rows, off


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", help="measure here, fit, and write the runs and the fit to this file")
    mode.add_argument("--check", help="refit a committed file's runs; exit 1 where speed.py differs")
    mode.add_argument("--refit", help="refit a committed file's runs under today's model and write it back")
    a = ap.parse_args()
    if a.out:
        with tempfile.TemporaryDirectory(prefix="dskit-cpu-fit-") as tmp:
            data = measure(Path(tmp))
    else:
        data = committed_runs(Path(a.check or a.refit))
    fitted, rows, bad = compare(data)
    for name, value in fitted.items():
        now = getattr(speed, name)
        print(f"{name:32s} fit {value:<10g} speed.py {now:<10g} {'<- differs' if name in bad else ''}")
    for r in rows:
        miss = _run(r) in bad
        print(
            f"{r['model']:16s} {r['candidate']} measured {r['measured_step_s']:.4f} predicted {r['predicted_step_s']:.4f} ({r['error']:+.1%}){' <- miss' if miss else ''}"
        )
    out = a.out or a.refit
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_file(Path(out), json.dumps({**data, "fit": fitted, "rows": rows}, indent=1) + "\n")
    return 1 if bad and a.check else 0


if __name__ == "__main__":
    sys.exit(main())
