"""What a user's calibration (`dskit calibrate`) changes in the step-time model, and where each term of
a prediction comes from (`dskit plan --explain`).

Collective rates are used as measured (dskit/plan/links.py). The other fitted constants of
dskit/plan/speed.py were fitted to whole training steps on the machine the bench ran on, and hold more
than a probe can see (the non-GEMM kernels in GEMM_EFFICIENCY, DeepSpeed's offload copies in the CPU
Adam rate), so a probe's reading does not replace them: it scales them by how this cluster compares
with that machine on the same probe. REFERENCE holds the probes' readings there (`dskit calibrate
local` on it); a calibration taken on that same machine type therefore leaves the fitted model as it
was validated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from dskit import catalog
from dskit.calibration import Calibration

#: the probes' readings on the machine the constants were fitted on (catalog data)
REFERENCE = Path(__file__).resolve().parent.parent / "catalog" / "calibration-reference.json"

MEASURED = "measured on this cluster"
FITTED = "fitted on the bench's H200 (dskit/plan/speed.py)"
SCALED = "fitted on the bench's H200, scaled by this cluster's probe"
CATALOG = "catalog (gpus.yaml, fabrics.yaml)"


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


def scales(cal: Calibration | None) -> Scales:
    """The factors `cal` implies against REFERENCE, and each term's source. GEMM rates compare as
    shares of each GPU's bf16 peak (the probe runs bf16)."""
    src = {
        "collectives": CATALOG,
        "all_to_all": f"{CATALOG}; AutoEP's share (A2A_EFFICIENCY) {FITTED}",
        "compute": FITTED,
        "host": FITTED,
        "cpu_adam": FITTED,
    }
    if cal is None:
        return Scales(sources=src)
    ref = reference()
    src["collectives"] = src["all_to_all"] = f"{MEASURED} (all-to-all: AutoEP's share {FITTED})"
    compute = host = adam = 1.0
    here, there = cal.compute, ref.compute
    peak, reference_peak = (catalog.gpu(c.hardware.gpu).peak_tflops_bf16 for c in (cal, ref))
    if here.gemm_tflops and there.gemm_tflops and peak and reference_peak:
        compute = (there.gemm_tflops / reference_peak) / (here.gemm_tflops / peak)
        src["compute"] = SCALED
    if here.host_layer_pass_s and there.host_layer_pass_s:
        host = here.host_layer_pass_s / there.host_layer_pass_s
        src["host"] = SCALED
    if cal.cpu_adam is not None and ref.cpu_adam is not None:
        adam = cal.cpu_adam.core_s_per_bparam / ref.cpu_adam.core_s_per_bparam
        src["cpu_adam"] = SCALED
    return Scales(compute, host, adam, src)
