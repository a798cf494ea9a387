"""Does the planner pick the fastest configuration that fits? Measured against its own predictions.

For each configuration (model depth, sequence length, global batch, GPUs), asks the planner for its
candidates (`build_plan_searched`), then trains the chosen one and the best rejected ones through the
real trainer (spec -> plan -> run.yaml -> `dskit train --local`), each forced through `overrides.*`,
and records measured step time, tokens/s/GPU and peak memory beside the plan's predictions.
One-GPU runs go to free GPUs in parallel; multi-GPU runs take the GPUs they need.

    python bench/plan_bench.py --set A --out $OUT/planner.json      # on the GPU machine
    python bench/plan_bench.py --report bench/results/planner/h200-planner-*.json   # here: the table, the goals
    python bench/plan_bench.py --fit bench/results/planner/h200-planner-*.json      # least-squares constants
    python bench/plan_bench.py --rows bench/results/planner/*.json --predict   # JSON, for the tests

Goals: peak memory (reserved: what must fit) within +-10% of the plan on every run; the planner's pick within 5% of
the fastest measured candidate; predicted tokens/s within +-15%.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import runs  # noqa: E402

_L4 = ["model.num_layers=4", "training.seq_len=4096", "training.global_batch=16"]
# name -> (spec sets, GPUs). A and B: the first fit; C: held out from it, then fitted with A; D: held out.
CONFIGS: dict[str, dict[str, tuple[list[str], int]]] = {
    "A": {
        "L4 s4096 gb16": (["model.num_layers=4", "training.seq_len=4096", "training.global_batch=16"], 1),
        "L4 s4096 gb2": (["model.num_layers=4", "training.seq_len=4096", "training.global_batch=2"], 1),
        "L8 s2048 gb32": (["model.num_layers=8", "training.seq_len=2048", "training.global_batch=32"], 1),
        "L2 s8192 gb8": (["model.num_layers=2", "training.seq_len=8192", "training.global_batch=8"], 1),
    },
    "B": {
        "L4 s4096 gb8 x2": (["model.num_layers=4", "training.seq_len=4096", "training.global_batch=8"], 2),
        "L8 s4096 gb16 x2": (["model.num_layers=8", "training.seq_len=4096", "training.global_batch=16"], 2),
    },
    "C": {
        "L12 s4096 gb4": (["model.num_layers=12", "training.seq_len=4096", "training.global_batch=4"], 1),
        "L6 s4096 gb8": (["model.num_layers=6", "training.seq_len=4096", "training.global_batch=8"], 1),
        "L3 s16384 gb2": (["model.num_layers=3", "training.seq_len=16384", "training.global_batch=2"], 1),
        "L4 s2048 gb64": (["model.num_layers=4", "training.seq_len=2048", "training.global_batch=64"], 1),
    },
    # held out from the fit of A + C (constants in speed.py fitted before D ran)
    "D": {
        "L10 s4096 gb8": (["model.num_layers=10", "training.seq_len=4096", "training.global_batch=8"], 1),
        "L5 s8192 gb4": (["model.num_layers=5", "training.seq_len=8192", "training.global_batch=4"], 1),
        "L4 s4096 gb32 x2": (["model.num_layers=4", "training.seq_len=4096", "training.global_batch=32"], 2),
        "L6 s2048 gb32 x2": (["model.num_layers=6", "training.seq_len=2048", "training.global_batch=32"], 2),
    },
    # LoRA on the full 27 layers (the plan counts frozen weights without gradients or states)
    "LORA": {
        "L27 s4096 gb32 lora": (
            ["finetune.method=lora", "training.seq_len=4096", "training.global_batch=32"],
            1,
        ),
        "L27 s4096 gb8 lora": (
            ["finetune.method=lora", "training.seq_len=4096", "training.global_batch=8"],
            1,
        ),
    },
    # what a frozen base keeps for backward and costs to recompute: the same shapes with and without
    # checkpointing
    "LORA-CAL": {
        "L4 s4096 gb16 lora": (["finetune.method=lora", *_L4], 1),
        "L4 s4096 gb16 lora ckpt1": (
            ["finetune.method=lora", *_L4, "overrides.activation_checkpointing=1"],
            1,
        ),
        "L4 s4096 gb16 full ckpt1": ([*_L4, "overrides.activation_checkpointing=1"], 1),
        "L12 s4096 gb8 lora": (
            [
                "finetune.method=lora",
                "model.num_layers=12",
                "training.seq_len=4096",
                "training.global_batch=8",
            ],
            1,
        ),
    },
}
#: model slices a configuration may train (`model.path={slice:NAME}` in its sets): a catalog model with
#: some of its config replaced, written to a config.json where both machines find it (`_resolve`)
SLICES: dict[str, tuple[str, dict]] = {
    # DeepSeek-V3's layers as EP 8 gives each GPU of the full model: 256 / 8 = 32 routed experts (top-8,
    # group-limited as V3: 8 groups, 4 of them per token), all-MoE, V3's width and vocabulary
    "v3-ep8-3l": (
        "deepseek-v3",
        {"num_hidden_layers": 3, "n_routed_experts": 32, "first_k_dense_replace": 0},
    ),
    # DeepSeek-V3's width where only 80 GB is lent (H100): 2 all-MoE layers of 16 routed experts (top-8
    # of 8 groups, 4 per token, as V3) and a 32k vocabulary, so the embedding and head (1.85 B parameters
    # at V3's 129k) leave room for the optimizer's states on one GPU; every product FP8 can convert is
    # V3's own shape
    "v3-h100-2l": (
        "deepseek-v3",
        {"num_hidden_layers": 2, "n_routed_experts": 16, "first_k_dense_replace": 0, "vocab_size": 32768},
    ),
}
CONFIGS["V3"] = {
    # the planner's compute and per-layer-pass terms at V3's width (hidden 7168, 128 heads,
    # top-8 of 2048-wide experts), fitted on V2-Lite only; micro-steps of one sequence as a pipeline
    # stage would run them (bench/pipeline_what_if.py)
    "V3s L3 s4096 gb8": (
        ["model.path={slice:v3-ep8-3l}", "training.seq_len=4096", "training.global_batch=8"],
        1,
    ),
    "V3s L3 s4096 gb2": (
        ["model.path={slice:v3-ep8-3l}", "training.seq_len=4096", "training.global_batch=2"],
        1,
    ),
    # held out from the refit of the optimizer terms at both widths (predicted before it ran)
    "V3s L3 s4096 gb4": (
        ["model.path={slice:v3-ep8-3l}", "training.seq_len=4096", "training.global_batch=4"],
        1,
    ),
}
#: what DeepSeek-V3's bias update costs a step at V3's width (one all-reduce of each MoE
#: layer's expert counts and an update of its bias, after the optimizer step), beside the frozen bias
CONFIGS["BALANCE"] = {
    f"V3s L3 s4096 gb2 {mode}": (
        [
            "model.path={slice:v3-ep8-3l}",
            "training.seq_len=4096",
            "training.global_batch=2",
            f"training.balance={mode}",
        ],
        1,
    )
    for mode in ("aux_free", "frozen")
}
#: ZeRO-3's optimizer offload, which the V2 and V3 cluster picks use, beside the same
#: candidate resident: the rate of DeepSpeed's CPU Adam was the ZeRO-Offload paper's until these ran.
#: The lent machine's host: 16 cores (OMP_NUM_THREADS 16 for the one rank), 128 GiB of RAM.
_HOST = ["hardware.cpus_per_node=16", "hardware.host_memory_gib=125"]
_Z3 = ["overrides.zero_stage=3", "overrides.ep_size=1", "overrides.activation_checkpointing=0"]
_SHAPES = (
    ("L4 s4096 gb16", _L4, 8),
    ("L8 s4096 gb8", ["model.num_layers=8", "training.seq_len=4096", "training.global_batch=8"], 4),
    ("L4 s4096 gb2", ["model.num_layers=4", "training.seq_len=4096", "training.global_batch=2"], 2),
)
CONFIGS["OFFLOAD"] = {
    f"{name} {where}": (
        [*shape, *_HOST, *_Z3, f"overrides.micro_batch={mb}", f"overrides.offload_optimizer={o}"],
        1,
    )
    for name, shape, mb in _SHAPES
    for where, o in (("offload", "cpu"), ("resident", "none"))
}
#: the first OFFLOAD call (h200-offload-2026-12-03.json) ran at a commit that also planned DeepSpeed's
#: partial offload and pinned `overrides.offload_ratio`, a field withdrawn before it landed
#: (docs/planner.md "Optimizer offload, measured"); its whole-offload rows pinned 1, DeepSpeed's default
WHOLE_OFFLOAD_PIN = "overrides.offload_ratio=1"


def partial_offload(row: dict) -> bool:
    """A row of DeepSpeed's partial offload: measured, not a choice the plan makes or can repredict."""
    return any(x.startswith("overrides.offload_ratio=") and x != WHOLE_OFFLOAD_PIN for x in row["sets"])


def planned_sets(row: dict) -> list[str]:
    """A row's spec sets as today's spec takes them."""
    return [x for x in row["sets"] if x != WHOLE_OFFLOAD_PIN]


COMMON = ["training.steps=10", "training.log_every=1", "checkpoint.every=1000", "checkpoint.final=false"]
WARMUP_STEPS = 3
MAX_RUNS_PER_CONFIG = 3  # the chosen + the fastest rejected fits (offload only if it is among them)


def _flags(gpus: int, name: str, work: Path, sets: list[str] = ()) -> dict:
    """The spec flags of a run: V2-Lite unless its sets name a model.path (a slice)."""
    flags = {
        "hardware.gpu": "h200-141gb",
        "hardware.gpus_per_node": gpus,
        "runtime.kind": "none",
        "storage.root": str(work / "storage"),
        "name": name,
    }
    if not any(x.startswith("model.path=") for x in sets):
        flags["model.preset"] = "deepseek-v2-lite"
    return flags


def _resolve(sets: list[str]) -> list[str]:
    """Sets with each `{slice:NAME}` replaced by the path of that slice's config.json, written on first
    use under the temp dir: the rows keep the placeholder, so `repredict` rebuilds the same model here."""
    from dskit import catalog

    out = []
    for x in sets:
        m = re.fullmatch(r"model\.path=\{slice:([\w-]+)\}", x)
        if m:
            model, changes = SLICES[m.group(1)]
            path = Path(tempfile.gettempdir()) / "dskit-bench-slices" / m.group(1) / "config.json"
            text = json.dumps({**catalog.model(model).config, **changes}, indent=1)
            if not path.exists() or path.read_text() != text:  # written whole: other processes read it
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".config-{os.getpid()}.json")
                tmp.write_text(text)
                os.replace(tmp, path)
            x = f"model.path={path}"
        out.append(x)
    return out


def candidates(
    sets: list[str],
    gpus: int,
    work: Path,
    compile_choice: str = "auto",
    zero_stage: int | None = None,
    optimizer_step: str = "auto",
) -> list[dict]:
    """The planner's fitting candidates for a configuration, chosen first, as override lists
    (`zero_stage`: the search narrowed to that ZeRO stage; `optimizer_step`: deepspeed plans and runs
    them as the calibration set's compiled rows ran, before the fused step)."""
    from dskit.plan.build import build_plan_searched
    from dskit.spec import load_spec

    stage = [f"overrides.zero_stage={zero_stage}"] if zero_stage else []
    spec = load_spec(
        sets=_resolve(
            [
                *COMMON,
                *sets,
                f"overrides.compile={compile_choice}",
                f"overrides.optimizer_step={optimizer_step}",
                *stage,
            ]
        ),
        flags=_flags(gpus, "probe", work, sets),
    )
    plan, found = build_plan_searched(spec)
    out = []
    for r in [r for r in found.rows if r.fits][:MAX_RUNS_PER_CONFIG]:
        c = r.candidate
        out.append(
            {
                "verdict": r.verdict,
                "overrides": _forced(
                    c.ep_size,
                    c.micro_batch,
                    c.ckpt_every,
                    c.offload,
                    _compile_value(plan.parallel.compile_regions, compile_choice),
                    c.zero_stage,
                    f"overrides.optimizer_step={optimizer_step}",
                ),
            }
        )
    return out


def _compile_value(compiled: bool, choice: str) -> str:
    """The overrides.compile a run is recorded with: what auto resolved to, regions kept apart."""
    return "off" if not compiled else "regions" if choice == "regions" else "on"


def _forced(
    ep: int,
    micro_batch: int,
    ckpt_every: int,
    offload: bool,
    compiled: bool | str,
    zero_stage: int = 3,
    optimizer_step: str = "overrides.optimizer_step=auto",
) -> list[str]:
    """A candidate as the overrides that force it, regional compile included (not searched: a plan-wide
    setting, on by default on GPUs)."""
    return [
        f"overrides.zero_stage={zero_stage}",
        f"overrides.ep_size={ep}",
        f"overrides.micro_batch={micro_batch}",
        f"overrides.activation_checkpointing={ckpt_every}",
        f"overrides.offload_optimizer={'cpu' if offload else 'none'}",
        f"overrides.compile={compiled if isinstance(compiled, str) else 'on' if compiled else 'off'}",
        optimizer_step,
    ]


def forced_overrides(row: dict) -> list[str]:
    """A row's overrides; rows measured before compile was an override ran eager, and those measured
    before the ZeRO stage was searched ran ZeRO-3."""
    o = list(row["overrides"])
    if not any(x.startswith("overrides.compile=") for x in o):
        o.append("overrides.compile=off")
    if not any(x.startswith("overrides.zero_stage=") for x in o):
        o.insert(0, "overrides.zero_stage=3")
    if not any(x.startswith("overrides.optimizer_step=") for x in o):
        # before the fused step: DeepSpeed's optimizer step, and compile=on compiled the regions only
        o = ["overrides.compile=regions" if x == "overrides.compile=on" else x for x in o]
        o.append("overrides.optimizer_step=deepspeed")
    return o


def config_key(row: dict) -> str:
    """Compiled and eager runs of a configuration are different searches: compared apart."""
    compiled = any(x in row["overrides"] for x in ("overrides.compile=on", "overrides.compile=regions"))
    return row["config"] + (" compiled" if compiled else "")


def run_one(config: str, sets: list[str], gpus: int, cand: dict, devices: list[int], work: Path) -> dict:
    from dskit.render.run_dir import render_run
    from dskit.spec import load_spec

    values = "-".join(o.split("=")[1] for o in cand["overrides"])  # stage-ep-mb-ckpt-offload
    name = re.sub(r"[^a-z0-9]+", "-", f"{config} {values}".lower()).strip("-")[-52:].strip("-")
    spec = load_spec(
        sets=_resolve([*COMMON, *sets, *cand["overrides"]]), flags=_flags(gpus, name, work, sets)
    )
    run = render_run(spec, "slurm", work / name)
    plan, run_dir = run.plan, run.out
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "dskit", "train", "--local", str(run_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    row = {
        "config": config,
        "sets": sets,
        "gpus": gpus,
        "planner_verdict": cand["verdict"],
        "overrides": cand["overrides"],
        "plan": plan.summary(),
        "predicted": {"memory_gib": plan.memory["total_gib"], **(plan.speed or {})},
        "memory_breakdown": {k: v for k, v in plan.memory.items() if not isinstance(v, dict)},
        "wall_s": round(time.time() - t0, 1),
        "inputs": _model_inputs(plan),
    }
    if proc.returncode != 0:
        row["error"] = (proc.stdout + proc.stderr)[-2500:]
        return row
    otherwise = runs.ran_otherwise(run_dir)
    if otherwise:  # a fallback is not a measurement of the plan: no measured figures
        row["error"] = f"{otherwise}; not recorded"
        return row
    recs = runs.step_records(run_dir)
    built = Path(plan.run.output_dir) / "construction-rank0.json"
    row["measured"] = {
        **runs.steady(recs, WARMUP_STEPS),
        # host RSS once the engine was built: offload's pinned states and gradient buffers are in it
        "construction": json.loads(built.read_text()) if built.is_file() else None,
        "step_s_all": [round(r["step_time_s"], 4) for r in recs],
    }
    return row


def _model_inputs(plan) -> dict:
    """What speed.py's measured constants multiply, for `--fit`."""
    from dskit.plan import speed

    par, cfg = plan.parallel, plan.model.config
    L = cfg["num_hidden_layers"]
    frac = speed.checkpointed_fraction(L, par.activation_checkpointing)
    tokens = par.micro_batch * par.seq_len
    return {
        "flop_s_at_peak": par.grad_accum
        * tokens
        * plan.model.flops_per_token
        * (1 + frac / 3)
        / (plan.hardware.peak_tflops * 1e12),
        "layer_passes": par.grad_accum * L * (2 + frac),
        "micro_steps": par.grad_accum,
    }


def measure(
    sets_to_run: list[str],
    out: Path,
    work: Path,
    budget_s: float | None = None,
    only: list[str] | None = None,
    picks_only: bool = False,
    compile_choice: str = "auto",
    zero_stages: list[int] | None = None,
    optimizer_step: str = "auto",
) -> None:
    import torch

    t_start = time.time()
    n_gpus = torch.cuda.device_count()
    result = {
        **runs.header(),
        "common": COMMON,
        "warmup_steps_excluded": WARMUP_STEPS,
        "rows": [],
    }
    lock = threading.Lock()

    def record(row: dict) -> None:
        with lock:
            result["rows"].append(row)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1) + "\n")
            print(_line(row), flush=True)

    jobs = []
    for s in sets_to_run:
        for config, (sets, gpus) in CONFIGS[s].items():
            if only and not any(o in config for o in only):
                continue
            for stage in zero_stages or [None]:  # side by side per configuration: a cut budget keeps pairs
                for cand in candidates(sets, gpus, work, compile_choice, stage, optimizer_step)[
                    : 1 if picks_only else None
                ]:
                    jobs.append((config, sets, gpus, cand))
    free = list(range(n_gpus))
    cond = threading.Condition()
    threads = []

    def worker(job, devices):
        try:
            record(run_one(*job, devices, work))
        except Exception as e:  # a broken run is a row, not a dead thread
            record({"config": job[0], "overrides": job[3]["overrides"], "error": repr(e)})
        finally:
            with cond:
                free.extend(devices)
                cond.notify_all()

    for job in jobs:
        if budget_s and time.time() - t_start > budget_s:
            record(
                {"config": job[0], "overrides": job[3]["overrides"], "error": "not started: --budget-s spent"}
            )
            continue
        need = job[2]
        if need > n_gpus:
            record({"config": job[0], "overrides": job[3]["overrides"], "error": f"needs {need} GPUs"})
            continue
        with cond:
            cond.wait_for(lambda need=need: len(free) >= need)
            devices = [free.pop(0) for _ in range(need)]
        t = threading.Thread(target=worker, args=(job, devices))
        t.start()
        threads.append(t)
        if need > 1:  # run it alone: its collectives would share the GPUs' links with nothing else
            t.join()
    for t in threads:
        t.join()


def _line(r: dict) -> str:
    head = f"{r['config']:18s} {' '.join(o.split('.')[-1] for o in r['overrides']):70s}"
    if "error" in r:
        return f"{head} ERROR {r['error'][-300:]!r}"
    p, m = r["predicted"], r["measured"]
    return (
        f"{head} pred {p.get('step_s', 0):6.3f}s {p['memory_gib']:6.1f}GiB | "
        f"meas {m['step_s']:6.3f}s {m['peak_alloc_gib']:6.1f}GiB ({m['peak_reserved_gib']:.1f} rsv) "
        f"{r['planner_verdict']}"
    )


def load_rows(files: list[Path]) -> list[dict]:
    out = []
    for f in files:
        d = json.loads(f.read_text())
        # the file's date: which trainer ran it (runs.as_measured)
        out += [{**r, "_date": d.get("date", "")} for r in d["rows"] if "measured" in r]
    return out


def derived(files: list[Path], predict: bool) -> list[dict]:
    """`--rows`: the measured rows of these files as the calibration tests read them (tests/support/calibration.py
    imports this), each with `_source` (its file under bench/results/),
    `_index` (its place among the file's measured rows), the forced overrides, the configuration key
    and whether it is a partial-offload row; `predict`: also today's prediction, verdict and pick, or
    `_error` where today's plan cannot be rebuilt for the row."""
    out = []
    for f in files:
        for i, r in enumerate(load_rows([f])):
            d = {
                **r,
                "_source": str(f.resolve().relative_to(runs.RESULTS)),
                "_index": i,
                "_forced_overrides": forced_overrides(r),
                "_config_key": config_key(r),
                "_partial_offload": partial_offload(r),
            }
            if predict and d["_partial_offload"]:
                d["_error"] = "DeepSpeed's partial offload: not a choice today's plan makes or can repredict"
            elif predict:
                try:
                    d["_predicted"], d["_verdict"] = repredict(r)
                    d["_pick"] = planner_pick(r)
                except Exception as e:  # the test that reads it fails with this
                    d["_error"] = repr(e)
            out.append(d)
    return out


def repredict(row: dict, work: Path = Path("/nonexistent")) -> tuple[dict, str]:
    """The current planner's prediction for a measured row (memory GiB, whether it fits, speed dict)
    and its verdict, read from the unforced search's candidate table: results stay comparable after
    the models change, also for a run the plan would now refuse as too large."""
    from dskit.plan.build import build_plan_searched
    from dskit.plan.candidate import Candidate
    from dskit.spec import load_spec

    o = dict(x.split("=", 1) for x in forced_overrides(row))
    sets = [
        *COMMON,
        *planned_sets(row),
        f"overrides.compile={o['overrides.compile']}",
        f"overrides.optimizer_step={o['overrides.optimizer_step']}",
    ]
    with runs.as_measured(row["_date"]):
        _, found = build_plan_searched(
            load_spec(sets=_resolve(sets), flags=_flags(row["gpus"], "x", work, sets))
        )
    want = Candidate(
        zero_stage=int(o["overrides.zero_stage"]),
        ep_size=int(o["overrides.ep_size"]),
        micro_batch=int(o["overrides.micro_batch"]),
        ckpt_every=int(o["overrides.activation_checkpointing"]),
        offload=o["overrides.offload_optimizer"] == "cpu",
    )
    r = next(x for x in found.rows if x.candidate == want)
    speed = r.speed.as_dict() if r.speed else {}
    return {"memory_gib": round(r.fit.steady.total_gib, 2), "fits": r.fits, **speed}, r.verdict


def planner_pick(row: dict) -> list[str]:
    """Today's planner's own choice for a row's configuration (compiled as the row was), as the
    overrides the bench forces, with the step-time and memory model of the trainer that ran the row
    (runs.as_measured): a pick is judged against runs that trainer made."""
    from dskit.plan.build import build_plan
    from dskit.spec import load_spec

    forced = forced_overrides(row)
    compiled = next(x for x in forced if x.startswith("overrides.compile=")).split("=", 1)[1]
    step = next(x for x in forced if x.startswith("overrides.optimizer_step="))
    sets = [*COMMON, *planned_sets(row), f"overrides.compile={compiled}", step]
    flags = _flags(row["gpus"], "x", Path("/nonexistent"), sets)
    with runs.as_measured(row.get("_date", "")):  # the pick of the model of the trainer that ran the rows
        p = build_plan(load_spec(sets=_resolve(sets), flags=flags)).parallel
    return _forced(
        p.ep_size,
        p.micro_batch,
        p.activation_checkpointing,
        p.offload_optimizer,
        compiled,
        p.zero_stage,
        step,
    )


def fastest_fitting(rows: list[dict]) -> float:
    """The best measured tokens/s/GPU among a configuration's runs that today's plan would take: a run
    that went through above the plan's memory limit (90% of the GPU) is not a candidate it may pick."""
    return max(r["measured"]["tokens_per_s_per_gpu"] for r in rows if repredict(r)[0]["fits"])


def report(files: list[Path]) -> dict:
    """The validation table and the three goals, per configuration, with today's model."""
    rows = load_rows(files)
    by_config: dict[str, list[dict]] = {}
    for r in rows:
        by_config.setdefault(config_key(r), []).append(r)
    print(
        f"{'configuration':27s} {'EP mbs ckpt offload':22s} {'pred s':>7s} {'meas s':>7s} {'tok/s err':>9s} "
        f"{'pred GiB':>8s} {'rsv GiB':>8s} {'mem err':>7s}  planner today"
    )
    summary: dict = {"memory_errors": [], "speed_errors": [], "pick_losses": {}}
    for config, rs in by_config.items():
        fastest = fastest_fitting(rs)
        pick = planner_pick(rs[0])
        for r in rs:
            p, m = repredict(r)[0], r["measured"]
            # the plan's total includes allocator slack: it is what the caching allocator reserves
            mem_err = p["memory_gib"] / m["peak_reserved_gib"] - 1
            tok_err = p["tokens_per_s_per_gpu"] / m["tokens_per_s_per_gpu"] - 1
            summary["memory_errors"].append(mem_err)
            summary["speed_errors"].append(tok_err)
            chosen = forced_overrides(r) == pick
            if chosen:
                summary["pick_losses"][config] = 1 - m["tokens_per_s_per_gpu"] / fastest
            cand = " ".join(o.split("=")[1] for o in r["overrides"][:4])
            print(
                f"{config:27s} {cand:22s} {p['step_s']:7.3f} {m['step_s']:7.3f} {tok_err:+9.1%} "
                f"{p['memory_gib']:8.1f} {m['peak_reserved_gib']:8.1f} {mem_err:+7.1%}  "
                + ("chosen" if chosen else "" if p["fits"] else "over the plan's memory limit")
            )
        if config not in summary["pick_losses"]:
            summary["pick_losses"][config] = None  # today's pick was not measured
    worst = lambda xs: max(xs, key=abs) if xs else 0.0  # noqa: E731
    print(
        f"\nworst memory error {worst(summary['memory_errors']):+.1%} (goal +-10%); worst tokens/s error "
        f"{worst(summary['speed_errors']):+.1%} (goal +-15%); planner's pick vs fastest measured: "
        + ", ".join(
            f"{k} {'unmeasured' if v is None else f'{v:.1%}'}" for k, v in summary["pick_losses"].items()
        )
        + " (goal <= 5%)"
    )
    return summary


def plot_validation(files: list[Path], path: Path) -> None:
    """Predicted against measured tokens/s and memory, one point per run, the goals' bands shaded."""
    from dskit.status.report import pyplot

    plt = pyplot()

    rows = load_rows(files)
    pred = [repredict(r)[0] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 5))
    for ax, key_p, key_m, band, unit in (
        (a1, "tokens_per_s_per_gpu", "tokens_per_s_per_gpu", 0.15, "k tokens/s/GPU"),
        (a2, "memory_gib", "peak_reserved_gib", 0.10, "GiB/GPU (peak reserved)"),
    ):
        scale = 1000 if key_p.startswith("tokens") else 1
        xs = [r["measured"][key_m] / scale for r in rows]
        ys = [p[key_p] / scale for p in pred]
        hi = max(xs + ys) * 1.1
        ax.fill_between(
            [0, hi],
            [0, hi * (1 - band)],
            [0, hi * (1 + band)],
            color="tab:green",
            alpha=0.15,
            label=f"goal: within {band:.0%}",
        )
        ax.plot([0, hi], [0, hi], color="gray", lw=1)
        for g, marker in ((1, "o"), (2, "s")):
            sel = [i for i, r in enumerate(rows) if r["gpus"] == g]
            ax.scatter([xs[i] for i in sel], [ys[i] for i in sel], marker=marker, label=f"{g} x H200")
        ax.set_xlabel(f"measured {unit}")
        ax.set_ylabel(f"planned {unit}")
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    a1.set_title("Step-time model (dskit/plan/speed.py)")
    a2.set_title("Memory model (dskit/plan/memory.py)")
    fig.suptitle(f"Planner vs measurement: {len(rows)} runs of 2-12-layer DeepSeek-V2-Lite on H200")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def fit_constants(files: list[Path]) -> None:
    """speed.py's one-GPU constants by minimising the worst relative step-time error (a grid: the
    max() of the two timelines is not linear) over one-GPU runs without offload."""
    import numpy as np

    rows = [
        r
        for r in load_rows(files)
        if r["gpus"] == 1
        and "offload_optimizer=none" in " ".join(r["overrides"])
        and "compile=off" in " ".join(forced_overrides(r))  # the constants are eager; compile scales them
    ]
    F, P, M = (
        np.array([r["inputs"][k] for r in rows]) for k in ("flop_s_at_peak", "layer_passes", "micro_steps")
    )
    # the optimizer after the micro-steps: true of these eager runs, measured before one rank's fused step
    # overlapped it (speed.OPTIMIZER_OVERLAPS_NEXT_STEP; bench/optimizer_refit.py fits the runs since)
    y = np.array([r["measured"]["step_s"] - r["predicted"]["optimizer_s"] for r in rows])
    best = None
    for eff in np.arange(0.30, 0.80, 0.01):
        for g in np.arange(0, 0.02, 0.0005):
            for b in np.arange(0, 0.03, 0.0005):
                for h in np.arange(0, 0.15, 0.005):
                    err = np.max(np.abs(np.maximum(F / eff + g * P, b * P + h * M) / y - 1))
                    if best is None or err < best[0]:
                        best = (err, eff, g, b, h)
    err, eff, g, b, h = best
    print(
        f"GEMM_EFFICIENCY = {eff:.2f}\nGPU_LAYER_PASS_S = {g:.4f}\nHOST_LAYER_PASS_S = {b:.4f}\n"
        f"HOST_MICRO_STEP_S = {h:.3f}\nworst step-time error {err:.1%} over {len(rows)} runs"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", choices=list(CONFIGS), help="configuration sets to measure")
    ap.add_argument("--out", type=Path, help="JSON file to write (rewritten after every run)")
    ap.add_argument("--work", type=Path, help="run dirs and logs (default: a temporary dir)")
    ap.add_argument("--only", action="append", help="only configurations whose name contains this")
    ap.add_argument("--budget-s", type=float, help="start no run after this many seconds")
    ap.add_argument("--picks-only", action="store_true", help="measure only the planner's pick of each")
    ap.add_argument(
        "--compile",
        choices=["auto", "on", "regions", "off"],
        default="auto",
        help="overrides.compile of every run (auto: on, as on GPUs; regions: attention eager; off: eager "
        "runs, which --fit refits)",
    )
    ap.add_argument(
        "--zero-stage",
        type=int,
        action="append",
        choices=[1, 2, 3],
        help="search only this ZeRO stage (repeat it: each stage's runs of a configuration side by side)",
    )
    ap.add_argument(
        "--optimizer-step",
        choices=["auto", "deepspeed"],
        default="auto",
        help="overrides.optimizer_step of every run (deepspeed: as the calibration set's compiled rows ran)",
    )
    ap.add_argument("--report", nargs="+", type=Path, help="print the validation table of result files")
    ap.add_argument("--plot", type=Path, help="with --report: draw predicted vs measured to this PNG")
    ap.add_argument("--fit", nargs="+", type=Path, help="fit speed.py's measured constants to result files")
    runs.add_rows_args(ap, "with --rows: today's prediction and pick of each")
    a = ap.parse_args()
    if a.rows:
        json.dump(derived(a.rows, a.predict), sys.stdout)
    elif a.report:
        report(a.report)
        if a.plot:
            plot_validation(a.report, a.plot)
    elif a.fit:
        fit_constants(a.fit)
    else:
        if not (a.set and a.out):
            ap.error("--set and --out are needed to measure")
        with tempfile.TemporaryDirectory(dir=a.work) as tmp:
            measure(
                a.set,
                a.out,
                Path(tmp),
                a.budget_s,
                a.only,
                a.picks_only,
                a.compile,
                a.zero_stage,
                a.optimizer_step,
            )


if __name__ == "__main__":
    main()
