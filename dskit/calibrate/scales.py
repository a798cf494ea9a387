"""What a user's calibration (`dskit calibrate`) changes in the fitted terms of the step-time model, and
where each comes from (`dskit plan --explain`; the collectives' sources are dskit/plan/links.py's).

Collective rates are used as measured (dskit/plan/links.py). The other fitted constants of
dskit/plan/speed.py were fitted to whole training steps on the machine the bench ran on, and hold more
than a probe can see (the non-GEMM kernels in GEMM_EFFICIENCY, DeepSpeed's offload copies in the CPU
Adam rate), so a probe's reading does not replace them: it scales them by how this cluster compares
with that machine on the same probe. REFERENCE holds the probes' readings there (`dskit calibrate
local` on it: the medians of four runs, bench/results/calibration/h200-calibrate-2026-12-04*.json).

A probe's reading moves between runs on one machine: over those four runs the GEMM rate stayed within
2% of the median, the host probe within -13..+27%, CPU Adam within -16..+17%. A ratio inside its
probe's SPREAD is not told apart from the reference machine and leaves the term unscaled (the source
says so); outside it, the term scales by the whole ratio.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from dskit import catalog
from dskit.calibrate.calibration import Calibration

#: the probes' readings on the machine the constants were fitted on (catalog data)
REFERENCE = Path(__file__).resolve().parent.parent / "catalog" / "calibration-reference.json"

#: a probe's run-to-run spread on one machine (above): ratios within it do not scale
SPREAD = {"compute": 0.05, "host": 0.30, "cpu_adam": 0.20}

FITTED = "fitted on the bench's H200 (dskit/plan/speed.py)"
SCALED = "fitted on the bench's H200, scaled by this cluster's probe"
SAME = "fitted on the bench's H200; this cluster's probe is within its run-to-run spread of that machine's"


@dataclass(frozen=True)
class Scales:
    """Factors on the fitted terms: 1.0 where nothing was measured."""

    compute: float = 1.0  # the compute term (the reference's achieved GEMM share of peak / this one's)
    host: float = 1.0  # the host timeline (this host's probe / the reference's)
    cpu_adam: float = 1.0  # CPU Adam's core-seconds per parameter (this node's / the reference's)
    sources: dict[str, str] = field(default_factory=dict)


@cache
def reference() -> Calibration:
    return Calibration.model_validate(json.loads(REFERENCE.read_text()))


def factors(cal: Calibration | None) -> Scales:
    """The factors `cal` implies against REFERENCE, and each term's source. GEMM rates compare as
    shares of each GPU's bf16 peak (the probe runs bf16)."""
    src = {"compute": FITTED, "host": FITTED, "cpu_adam": FITTED}
    if cal is None:
        return Scales(sources=src)
    ref = reference()
    found = {"compute": 1.0, "host": 1.0, "cpu_adam": 1.0}
    here, there = cal.compute, ref.compute
    peak, reference_peak = (catalog.gpu(c.hardware.gpu).peak_tflops_bf16 for c in (cal, ref))
    if here.gemm_tflops and there.gemm_tflops and peak and reference_peak:
        found["compute"] = (there.gemm_tflops / reference_peak) / (here.gemm_tflops / peak)
    if here.host_layer_pass_s and there.host_layer_pass_s:
        found["host"] = here.host_layer_pass_s / there.host_layer_pass_s
    if cal.cpu_adam is not None and ref.cpu_adam is not None:
        found["cpu_adam"] = cal.cpu_adam.core_s_per_bparam / ref.cpu_adam.core_s_per_bparam
    measured = {"compute": here.gemm_tflops, "host": here.host_layer_pass_s, "cpu_adam": cal.cpu_adam}
    for term, ratio in found.items():
        if measured[term] is None:
            continue
        if abs(math.log(ratio)) <= math.log(1 + SPREAD[term]):
            found[term] = 1.0
            src[term] = f"{SAME} (x{ratio:.2f})"
        else:
            src[term] = f"{SCALED} (x{ratio:.2f})"
    return Scales(found["compute"], found["host"], found["cpu_adam"], src)
