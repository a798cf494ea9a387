"""`dskit calibrate local --candidates N`: train the plan's top N candidates for a few steps each on this
machine, once the calibration is written, and record what each measured beside what the plan (now
calibrated) predicted, in `candidates.json` beside the calibration.

Each candidate is the user's spec with its configuration pinned through `overrides.*` (the way a user
would force it), a short run without checkpoints, rendered and started like any local run. Its speed is
the median of the steps after a warm-up; its memory the peak the trainer logged. The records are the
user's evidence of how far to trust the prediction on their hardware, a report the plan does not read:
they hold for one model, sequence and batch, while the calibration holds for every plan of its hardware,
so they live in their own file, not in the calibration (which holds only what the plan uses).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from dskit.calibrate.measures import job_name
from dskit.io import bounded_read
from dskit.io.atomic import write_file
from dskit.launch.contract import METRICS_FILE
from dskit.plan.build import build_plan_searched
from dskit.spec import Spec
from dskit.status.report import MAX_METRICS_LINE

#: steps per candidate, of which the first WARMUP are not timed (compilation, allocator growth)
STEPS, WARMUP = 8, 3
#: the report's name, beside the calibration file
REPORT = "candidates.json"


class CandidateRun(BaseModel):
    """One of the plan's candidates trained for a few steps after calibrating."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    candidate: str
    predicted_tokens_per_s: int | None  # None: the plan predicted no speed for it
    measured_tokens_per_s: int
    predicted_gib: float
    measured_peak_gib: float
    steps: int


class Report(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    calibration: str  # the calibration the predictions were made with
    candidates: list[CandidateRun]


def report_path(cal_file: Path) -> Path:
    return Path(cal_file).with_name(REPORT)


def pins(c) -> list[str]:
    """The overrides that force candidate `c`, as `--set` values."""
    return [
        f"overrides.zero_stage={c.zero_stage}",
        f"overrides.ep_size={c.ep_size}",
        f"overrides.micro_batch={c.micro_batch}",
        f"overrides.activation_checkpointing={c.ckpt_every}",
        f"overrides.offload_optimizer={'cpu' if c.offload else 'none'}",
        f"training.steps={STEPS}",
        "training.log_every=1",
        "checkpoint.final=false",
        f"checkpoint.every={STEPS + 1}",
    ]


class CandidateFailed(Exception):
    """A candidate's run failed (not bad input): the records before it are in the file."""


def measure(spec_with: Callable[..., Spec], cal_file: Path, n: int, out_root: Path) -> list[CandidateRun]:
    """Train the top `n` fitting candidates of the calibrated plan; `spec_with(extra_sets, name=None)`
    is the user's spec with more `--set` values (and another run name). Writes the records to
    `report_path(cal_file)` (atomically, after each candidate) and returns them."""
    from dskit.render.run_dir import render_run
    from dskit.train.local import run_local

    _, found = build_plan_searched(spec_with([f"hardware.calibration={cal_file}"]))
    rows = [r for r in found.rows if r.fits][:n]
    records = []
    for i, row in enumerate(rows):
        c = row.candidate
        print(f"dskit: calibrate: candidate {i + 1}/{len(rows)}: {c.describe()} ({STEPS} steps)", flush=True)
        base = spec_with([])
        spec = spec_with(pins(c), name=job_name(base.name, f"candidate{i + 1}"))
        run = render_run(spec, "slurm", out_root / f"candidate-{i + 1}", force=True)
        metrics = Path(run.plan.run.output_dir) / METRICS_FILE
        before = len(_records(metrics))  # the trainer appends: an earlier call's records are not this run's
        code = run_local(str(run.out))
        if code != 0:
            raise CandidateFailed(
                f"candidate {i + 1} ({c.describe()}) exited with {code} (its log is above); "
                f"{len(records)} record(s) before it are in {report_path(cal_file)}"
            )
        records.append(_record(row, _records(metrics)[before:]))
        report = Report(calibration=str(cal_file), candidates=records)
        write_file(report_path(cal_file), report.model_dump_json(indent=1) + "\n")
    return records


def _records(path: Path) -> list[dict]:
    """The trainer's records in metrics.jsonl, read as `dskit report` reads them (bounded lines; a torn
    line skipped)."""
    if not path.is_file():
        return []
    lines = bounded_read.iter_jsonl(path, line_limit=MAX_METRICS_LINE, what=METRICS_FILE)
    return [r for r in lines if isinstance(r, dict)]


def _record(row, records: list[dict]) -> CandidateRun:
    recs = [r for r in records if "step_time_s" in r]
    after = [r for r in recs if r["step"] > WARMUP] or recs
    return CandidateRun(
        candidate=row.candidate.describe(),
        predicted_tokens_per_s=round(row.speed.tokens_per_s) if row.speed else None,
        measured_tokens_per_s=round(statistics.median(r["tokens_per_s_per_gpu"] for r in after)),
        predicted_gib=round(row.fit.steady.total_gib, 2),
        measured_peak_gib=round(max(r["peak_reserved_gib"] for r in recs), 2),
        steps=len(recs),
    )


def table(records: list[CandidateRun]) -> str:
    lines = ["candidate | predicted tok/s/GPU | measured | predicted GiB | peak GiB"]
    for r in records:
        pred = f"{r.predicted_tokens_per_s:,}" if r.predicted_tokens_per_s is not None else "-"
        lines.append(
            f"{r.candidate} | {pred} | {r.measured_tokens_per_s:,} | {r.predicted_gib} | {r.measured_peak_gib}"
        )
    return "\n".join(lines)
