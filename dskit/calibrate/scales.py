"""What a user's calibration (`dskit calibrate`) changes in the fitted terms of the step-time model, and
where each comes from (`dskit plan --explain`; the collectives' sources are dskit/plan/links.py's).

Collective rates are used as measured (dskit/plan/links.py). The other fitted constants of
dskit/plan/speed.py were fitted to whole training steps on a reference machine, and hold more than a
probe can see (the non-GEMM kernels in GEMM_EFFICIENCY, DeepSpeed's offload copies in the CPU Adam
rate), so a probe's reading does not replace them: it scales them by how this cluster compares with
that machine on the same probe. There is a reference machine per kind of device: the bench's H200 for
GPU ranks (`dskit calibrate local` on it: the medians of four runs,
bench/results/calibration/h200-calibrate-2026-12-04*.json), and this project's 2-core development
machine for CPU ranks (the cpu profile, whose constants were fitted there: dskit/plan/speed.py "CPU
ranks"). `REFERENCES` holds their probes' readings.

Terms and their probes: compute by the GEMM probe on GPUs (as shares of each GPU's bf16 peak, since the
probe runs bf16) and by the host probe on CPU ranks (the tiny models' small kernels are bound by
per-operation overhead, not GEMM throughput: dskit/plan/speed.py "CPU ranks"), attention by the attention probe (GPUs; as shares of peak likewise), the host timeline by the
host probe, CPU Adam (optimizer offload, a CPU rank's optimizer) by its own.

A probe's reading moves between runs on one machine: over the four H200 runs the GEMM rate stayed
within 2% of the median, the host probe within -13..+27%, CPU Adam within -16..+17%. Every ratio scales
its term, however near 1: a band inside which a reading counted as the reference's made the prediction
jump where a reading crossed its edge (the same 2-node CPU cluster's host probe read x1.71 in one
calibration, scaled, and x1.30 in the next, inside a 30% band and dropped), and left an H200 whose
probes all fell inside their bands uncorrected by its calibration.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from dskit import catalog
from dskit.calibrate.calibration import Calibration

_CATALOG = Path(__file__).resolve().parent.parent / "catalog"
#: the probes' readings on the reference machine of each kind of device (catalog data)
REFERENCES = {
    "gpu": _CATALOG / "calibration-reference.json",
    "cpu": _CATALOG / "calibration-reference-cpu.json",
}
#: the reference machines, as the sources name them
MACHINES = {"gpu": "the bench's H200", "cpu": "the CPU reference machine (2 cores)"}

TERMS = ("compute", "attention", "host", "cpu_adam")


def fitted(kind: str) -> str:
    return f"fitted on {MACHINES[kind]} (dskit/plan/speed.py)"


def scaled(kind: str) -> str:
    return f"fitted on {MACHINES[kind]}, scaled by this cluster's probe"


FITTED, SCALED = fitted("gpu"), scaled("gpu")


@dataclass(frozen=True)
class Scales:
    """Factors on the fitted terms: 1.0 where nothing was measured."""

    compute: float = 1.0  # the compute term (GPUs: the reference's achieved GEMM share of peak / this
    # one's; CPU ranks: the host probe's ratio, dskit/plan/speed.py "CPU ranks")
    attention: float = 1.0  # the attention FLOPs of it, likewise by the attention probe
    host: float = 1.0  # the host timeline (this host's probe / the reference's)
    cpu_adam: float = 1.0  # CPU Adam's core-seconds per parameter (this node's / the reference's)
    sources: dict[str, str] = field(default_factory=dict)
    #: the GEMM rate measured here, TFLOP/s: a CPU rank's peak for its MFU (it has no catalog peak)
    gemm_tflops: float | None = None


def kind_of(gpu: str) -> str:
    return "cpu" if catalog.gpu(gpu).is_cpu else "gpu"


@cache
def reference(kind: str = "gpu") -> Calibration:
    return Calibration.model_validate(json.loads(REFERENCES[kind].read_text()))


def factors(cal: Calibration | None, kind: str = "gpu") -> Scales:
    """The factors `cal` implies against its kind's reference machine, and each term's source (`kind`:
    the plan's device kind, for the sources where there is no calibration)."""
    if cal is not None:
        kind = kind_of(cal.hardware.gpu)
    src = dict.fromkeys(TERMS, fitted(kind))
    if cal is None:
        return Scales(sources=src)
    ref = reference(kind)
    here, there = cal.compute, ref.compute
    found = dict.fromkeys(TERMS, 1.0)
    peak, reference_peak = (catalog.gpu(c.hardware.gpu).peak_tflops_bf16 for c in (cal, ref))
    # GPUs' rates compare as shares of each GPU's bf16 peak: not where the catalog has none (V100)
    shares = kind == "gpu" and bool(peak) and bool(reference_peak)
    for term, probe in (("compute", "gemm_tflops"), ("attention", "attention_tflops")):
        rate, rate_there = getattr(here, probe), getattr(there, probe)
        if rate and rate_there and shares:
            found[term] = (rate_there / reference_peak) / (rate / peak)
    if here.host_layer_pass_s and there.host_layer_pass_s:
        found["host"] = here.host_layer_pass_s / there.host_layer_pass_s
        if kind == "cpu":  # a CPU rank's compute: per-operation overhead, as the host probe times it
            found["compute"] = found["host"]
    if cal.cpu_adam is not None and ref.cpu_adam is not None:
        found["cpu_adam"] = cal.cpu_adam.core_s_per_bparam / ref.cpu_adam.core_s_per_bparam
    measured = {
        "compute": here.host_layer_pass_s if kind == "cpu" else here.gemm_tflops if shares else None,
        "attention": here.attention_tflops if shares else None,
        "host": here.host_layer_pass_s,
        "cpu_adam": cal.cpu_adam,
    }
    for term, ratio in found.items():
        if measured[term] is not None:
            src[term] = f"{scaled(kind)} (x{ratio:.2f})"
    return Scales(
        found["compute"],
        found["attention"],
        found["host"],
        found["cpu_adam"],
        src,
        gemm_tflops=here.gemm_tflops,
    )
