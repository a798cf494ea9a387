"""The optimizer refit of 2026-12-02 (docs/planner.md "The optimizer step at both widths"), redone
from the committed H200 runs: each group of `dskit/plan/speed.py` constants on its grid, scored by the
worst relative tokens/s error of today's plan (`plan_bench.repredict`) over the runs it governs.

- ZeRO-1/2: ZERO12_STEP_BYTES_PER_PARAM x GPU_LAYER_PASS_UNHOOKED_S over every one-GPU ZeRO-1/2 run
  of both widths (V2-Lite and the V3-width slice);
- their host bounds: the largest HOST_LAYER_PASS_UNHOOKED_S (runs with attention eager) and
  HOST_LAYER_PASS_COMPILED_ATTENTION_S (attention compiled) at which the host timeline makes no run's
  predicted step slower than both its measurement (by 2%) and what the GPU timeline alone predicts;
- ZeRO-3: ADAM_BYTES_PER_PARAM x SYNC_LAYER_PASS_S over every ZeRO-3 run, one and two GPUs;
- LoRA: LORA_LAYER_PASS_FACTOR over the LoRA calibration runs and the FP8-bench runs.
The gradient-copy bytes are not fitted (4 + 6 bytes by count, 10 measured at V3's width). Each group
is fitted with the others at speed.py's values. Prints the fits beside speed.py's; exits 1 if one
differs (`--near`: each grid only the committed value and its two neighbours; `--check`, what
tests/plan/test_optimizer_refit.py runs: `--near`, and every constant of GRIDS must be refitted).

    python bench/optimizer_refit.py
    python bench/optimizer_refit.py --check
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import fp8_lora_bench, plan_bench, runs  # noqa: E402
from dskit.plan import speed  # noqa: E402

GRIDS: dict[str, tuple[float, ...]] = {
    "ZERO12_STEP_BYTES_PER_PARAM": (48.0, 54.0, 60.0, 66.0, 72.0, 78.0),
    "GPU_LAYER_PASS_UNHOOKED_S": (0.0035, 0.004, 0.0045, 0.005, 0.0055, 0.006),
    "HOST_LAYER_PASS_UNHOOKED_S": tuple(round(0.004 + 0.0005 * i, 4) for i in range(13)),
    "HOST_LAYER_PASS_COMPILED_ATTENTION_S": tuple(round(0.004 + 0.0005 * i, 4) for i in range(13)),
    "ADAM_BYTES_PER_PARAM": (56.0, 64.0, 72.0, 80.0, 88.0, 96.0),
    "SYNC_LAYER_PASS_S": (0.002, 0.0025, 0.003, 0.0035, 0.004),
    "LORA_LAYER_PASS_FACTOR": (0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7),
    "GPU_LAYER_PASS_FLAT_S": tuple(round(0.002 + 0.00025 * i, 5) for i in range(17)),
    "HOST_LAYER_PASS_FLAT_S": tuple(round(0.002 + 0.0005 * i, 4) for i in range(9)),
}
#: how much slower than measured a host bound may make a run's prediction
HOST_SLACK = 0.02
#: FP8-bench runs measured before the trainer set train mode (tests/plan/test_plan_calibration.py)
EVAL_MODE_RUNS = {
    ("h200-fp8-lora-routed-2026-12-02.json", "bf16"),
    ("h200-fp8-lora-routed-ckpt-2026-12-02.json", "bf16-ckpt1"),
}


def _rows(*series: str) -> list[dict]:
    """The runs of these result series that ran the plan's own kernels: a row marked `attention_ran`
    fell back from the planned attention (its call lacked the kernel's wheels), which compares stages
    run side by side but is not the step the constants describe."""
    rows = plan_bench.load_rows(runs.results(*series))
    return [r for r in rows if "attention_ran" not in r]


def _stage(r: dict) -> int:
    return int(plan_bench.forced_overrides(r)[0].split("=")[1])


def _attention_compiled(r: dict) -> bool:
    return "overrides.compile=on" in plan_bench.forced_overrides(r)


@contextmanager
def constants(**values: float) -> Iterator[None]:
    with runs.patched(speed, **values):
        yield


def _error(r: dict, tmp: Path) -> float:
    p = fp8_lora_bench.repredict(r, tmp) if "file" in r else plan_bench.repredict(r)[0]
    return p["tokens_per_s_per_gpu"] / r["measured"]["tokens_per_s_per_gpu"] - 1


def worst(rows: list[dict], tmp: Path) -> float:
    return max(abs(_error(r, tmp)) for r in rows)


def _grid(name: str, near: bool) -> tuple[float, ...]:
    g = GRIDS[name]
    if not near:
        return g
    i = min(range(len(g)), key=lambda k: abs(g[k] - getattr(speed, name)))
    return g[max(0, i - 1) : i + 2]


def fit_pair(a: str, b: str, rows: list[dict], tmp: Path, near: bool) -> tuple[float, float, float]:
    """The (a, b) of the grid with the smallest worst error over `rows`, and that error."""
    best = None
    for x in _grid(a, near):
        for y in _grid(b, near):
            with constants(**{a: x, b: y}):
                err = worst(rows, tmp)
            if best is None or err < best[2] - 1e-12:
                best = (x, y, err)
    assert best is not None
    return best


def _step(r: dict) -> float:
    return plan_bench.repredict(r)[0]["step_s"]


def host_bound(name: str, rows: list[dict], near: bool) -> float:
    """The largest host cost per pass at which no run is predicted slower than both its measurement
    (by HOST_SLACK) and its GPU timeline alone (the host bound at zero)."""
    with constants(**{name: 0.0}):
        gpu_only = [_step(r) for r in rows]
    ok = 0.0
    for h in _grid(name, near):
        with constants(**{name: h}):
            steps = [_step(r) for r in rows]
        if all(
            s <= max(r["measured"]["step_s"] * (1 + HOST_SLACK), g) + 1e-9
            for s, r, g in zip(steps, rows, gpu_only, strict=True)
        ):
            ok = h
        else:
            break
    return ok


def refit(near: bool = False) -> list[tuple[str, float, float, str]]:
    """(constant, fitted, speed.py's, what it was scored on) for every constant of the refit."""
    tmp = Path(tempfile.mkdtemp(prefix="dskit-refit-"))
    planner = _rows("planner", "v3-width", "zero1", "zero12")
    zero12 = [r for r in planner if _stage(r) < 3 and r["gpus"] == 1]
    zero3 = [r for r in planner if _stage(r) == 3]
    host = [r for r in zero12 if r["config"] == "L4 s4096 gb2"]  # the host-bound shape
    lora = _rows("lora") + [
        r
        for r in fp8_lora_bench.load_rows(runs.results("fp8-lora"))
        if (r["file"], r["label"]) not in EVAL_MODE_RUNS
    ]
    out: list[tuple[str, float, float, str]] = []

    def put(name: str, value: float, how: str) -> None:
        out.append((name, value, getattr(speed, name), how))

    b, g, e = fit_pair("ZERO12_STEP_BYTES_PER_PARAM", "GPU_LAYER_PASS_UNHOOKED_S", zero12, tmp, near)
    put("ZERO12_STEP_BYTES_PER_PARAM", b, f"worst {e:.1%} over {len(zero12)} one-GPU ZeRO-1/2 runs")
    put("GPU_LAYER_PASS_UNHOOKED_S", g, "with it")
    eager = [r for r in host if not _attention_compiled(r)]
    compiled = [r for r in host if _attention_compiled(r)]
    put(
        "HOST_LAYER_PASS_UNHOOKED_S",
        host_bound("HOST_LAYER_PASS_UNHOOKED_S", eager, near),
        f"bound, {len(eager)} runs",
    )
    name = "HOST_LAYER_PASS_COMPILED_ATTENTION_S"
    put(name, host_bound(name, compiled, near), f"bound, {len(compiled)} runs")
    a, s, e = fit_pair("ADAM_BYTES_PER_PARAM", "SYNC_LAYER_PASS_S", zero3, tmp, near)
    put("ADAM_BYTES_PER_PARAM", a, f"worst {e:.1%} over {len(zero3)} ZeRO-3 runs")
    put("SYNC_LAYER_PASS_S", s, "with it")
    best = min(_grid("LORA_LAYER_PASS_FACTOR", near), key=lambda f: _with(f, lambda: worst(lora, tmp)))
    put(
        "LORA_LAYER_PASS_FACTOR",
        best,
        f"worst {_with(best, lambda: worst(lora, tmp)):.1%} over {len(lora)} LoRA-bench runs",
    )
    flat, late = _flat_rows()
    g = min(_grid("GPU_LAYER_PASS_FLAT_S", near), key=lambda v: _flat_worst(late, GPU_LAYER_PASS_FLAT_S=v))
    put(
        "GPU_LAYER_PASS_FLAT_S",
        g,
        f"worst {_flat_worst(late, GPU_LAYER_PASS_FLAT_S=g):.1%} over {len(late)} runs with log records a step late",
    )
    both = flat + late
    put("HOST_LAYER_PASS_FLAT_S", _flat_host_bound(both, near), f"bound, {len(both)} runs")
    return out


def _flat_rows() -> tuple[list[dict], list[dict]]:
    """The one-GPU runs beside torchtitan whose gradients went flat: those that waited for the GPU at each
    log step (series small-shapes, H200; re-predicted with runs.GPU_LAYER_PASS_FLAT_SYNCED_S, fitted then)
    and those that wrote their records a step late (series host-bound-late, H100: the GPU constant's fit)."""
    from bench import peer_bench

    rows = peer_bench.derived(runs.results("small-shapes"), predict=False)
    late = peer_bench.derived(runs.results("host-bound-late"), predict=False)
    assert all(r["_date"] >= runs.DEFERRED_LOGS_SINCE for r in late), (
        "a host-bound-late run predates the late records"
    )
    return [r for r in rows if r["_date"] >= runs.FLAT_SINCE], late


def _flat_tok_s(rows: list[dict], **values: float) -> list[float]:
    from bench import peer_bench

    with constants(**values):
        return [peer_bench.repredict(r, r["_date"])["tokens_per_s_per_gpu"] for r in rows]


def _flat_worst(rows: list[dict], **values: float) -> float:
    return max(abs(p / r["tok_s_gpu"] - 1) for p, r in zip(_flat_tok_s(rows, **values), rows, strict=True))


def _flat_host_bound(rows: list[dict], near: bool) -> float:
    """host_bound()'s rule on these runs, in tokens/s: no run predicted slower than both its measurement
    (by HOST_SLACK) and its GPU timeline alone."""
    gpu_only = _flat_tok_s(rows, HOST_LAYER_PASS_FLAT_S=0.0, HOST_MICRO_STEP_FUSED_S=0.0)
    ok = 0.0
    for h in _grid("HOST_LAYER_PASS_FLAT_S", near):
        got = _flat_tok_s(rows, HOST_LAYER_PASS_FLAT_S=h)
        if all(
            p >= min(r["tok_s_gpu"] / (1 + HOST_SLACK), g) - 1e-6
            for p, r, g in zip(got, rows, gpu_only, strict=True)
        ):
            ok = h
        else:
            break
    return ok


def _with(factor: float, f: Callable[[], float]) -> float:
    with constants(LORA_LAYER_PASS_FACTOR=factor):
        return f()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--near", action="store_true", help="each grid only around speed.py's value (quick)")
    ap.add_argument(
        "--check",
        action="store_true",
        help="the self-test tests/plan/test_optimizer_refit.py runs: --near, every constant of GRIDS refitted",
    )
    a = ap.parse_args()
    fits = refit(a.near or a.check)
    if a.check and {name for name, *_ in fits} != set(GRIDS):
        sys.exit(f"refitted {sorted(name for name, *_ in fits)}, GRIDS has {sorted(GRIDS)}")
    print(f"{'constant':38s} {'fitted':>8s} {'speed.py':>8s}  scored on")
    for name, fitted, committed, how in fits:
        print(f"{name:38s} {fitted:8g} {committed:8g}  {how}" + ("" if fitted == committed else "  DIFFERS"))
    sys.exit(0 if all(f == c for _, f, c, _ in fits) else 1)


if __name__ == "__main__":
    main()
