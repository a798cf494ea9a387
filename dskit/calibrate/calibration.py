"""The calibration file: what `dskit calibrate` measured on a cluster, and the one reader the plan uses.

Written by the calibration job's rank 0 (dskit/calibrate/job.py), read by the plan
(`hardware.calibration` or `--calibration`) through `load`. It names the hardware it was measured on;
a plan for other hardware, a file from another version, or a damaged one is refused in one line, never
half-used. Neither side decides anything here: the measurement writes numbers, the step-time model
(dskit/plan/links.py, dskit/plan/speed.py) decides what they mean.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dskit import catalog
from dskit.errors import SpecError
from dskit.io import bounded_read
from dskit.io.atomic import write_file

VERSION = 2
#: a calibration of a few hundred groups and sizes is tens of KiB: anything near this is not one
MAX_BYTES = 4 * 2**20
SHAPE_KEY = r"^[1-9][0-9]{0,3}x[1-9][0-9]{0,4}$"
#: AutoEP's dispatch and combine over an expert-parallel group, timed as a MoE layer runs them (its count
#: exchange and uneven splits included: dskit/calibrate/job.py `_exchange_s`), beside the ring collectives
EXCHANGE = "autoep_exchange"
#: what the file times, by the names the file and the step-time model use: the collectives ZeRO runs, as
#: rings (a ring's bus bandwidth does not depend on its length), and AutoEP's exchange
RING_OPS = ("all_gather", "reduce_scatter")
OPS = (*RING_OPS, EXCHANGE)
#: the longest text of the file that is echoed (warnings, names in refusals)
ECHO_CHARS = 300

# Physical bounds of what a calibration can hold: each spans every machine that trains by orders of
# magnitude, so a value outside is damage, and each keeps the step-time model's arithmetic finite (a
# GEMM rate of 5e-324 TFLOP/s or a host pass of 1e308 s passed a bare "positive" check, then divided by
# zero in the plan). A measured GPU rate is also held under the catalog's peak (`load`).
#: bus bandwidth, GB/s: 1 kB/s (a link nothing trains over) to 100 TB/s (beyond any NVLink domain)
BUS_GBS = (1e-6, 1e5)
#: a collective's fitted latency, s: at most 10 s (NCCL's slowest rings are milliseconds)
LATENCY_S = 10.0
#: a timed point: bytes up to 1 PiB, seconds up to an hour
POINT_BYTES, POINT_S = 2.0**50, 3600.0
#: a probe's rate, TFLOP/s: 0.1 GFLOP/s (below any core's) to 10 PFLOP/s (beyond any one device's)
TFLOPS = (1e-4, 1e4)
#: the host's time per layer pass, s: 100 ns to 1 s (the probes read 50-170 us)
HOST_LAYER_S = (1e-7, 1.0)
#: DeepSpeed CPU Adam, core-seconds per billion parameters (the probes read 1.3-2.4)
CPU_ADAM_S = (1e-3, 1e4)
#: a measured GPU rate may exceed the catalog's bf16 peak by this much (a probe's timing noise) and no more
PEAK_MARGIN = 1.1


class _Frozen(BaseModel):
    # a number that is not finite is damage, never a rate (json.loads reads NaN and Infinity)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Hardware(_Frozen):
    """What the plan must match to use the file (gpu, fabric, procs_per_node) and what it records."""

    gpu: str  # the catalog profile the calibration job was planned for
    fabric: str
    nodes: int = Field(ge=1, le=100_000)
    procs_per_node: int = Field(ge=1, le=1024)
    device: str  # torch's device name ("NVIDIA H200", "cpu")
    backend: str  # nccl, gloo
    torch: str
    nccl: str | None
    driver: str | None


class Fit(_Frozen):
    """One collective over one group shape: latency + bytes sent / bus bandwidth, fitted by least
    squares to the timed points (whole-tensor bytes, seconds)."""

    bus_gbs: float = Field(ge=BUS_GBS[0], le=BUS_GBS[1])
    latency_s: float = Field(ge=0, le=LATENCY_S)
    points: list[
        tuple[Annotated[float, Field(ge=1, le=POINT_BYTES)], Annotated[float, Field(gt=0, le=POINT_S)]]
    ]


class CpuAdam(_Frozen):
    # DeepSpeed's CPU Adam with every rank of a node stepping
    core_s_per_bparam: float = Field(ge=CPU_ADAM_S[0], le=CPU_ADAM_S[1])
    ranks: int = Field(ge=1, le=1024)
    threads_per_rank: int = Field(ge=1, le=4096)


class Compute(_Frozen):
    """The probes, at fixed shapes so that clusters compare (dskit/calibrate/measures.py)."""

    gemm_tflops: float | None = Field(None, ge=TFLOPS[0], le=TFLOPS[1])  # bf16 matmul
    # SDPA forward + backward, MLA's head dims
    attention_tflops: float | None = Field(None, ge=TFLOPS[0], le=TFLOPS[1])
    # the host probe (dskit/calibrate/job.py)
    host_layer_pass_s: float | None = Field(None, ge=HOST_LAYER_S[0], le=HOST_LAYER_S[1])


class Calibration(_Frozen):
    version: int
    dskit: str
    created: str  # UTC, ISO 8601
    hardware: Hardware
    #: op -> group shape key ("8x2": 8 ranks on each of 2 nodes) -> fit
    collectives: dict[str, dict[str, Fit]]
    compute: Compute = Compute()
    cpu_adam: CpuAdam | None = None
    #: the preflight's findings: a group far below what its fabric should give
    warnings: list[str] = []  # echoed through `echo` by the reader (`warning_lines`)

    def nearest(self, op: str, key: str) -> tuple[Fit, str] | None:
        """The fit of `op` measured over groups shaped `key`, with `key`; for a ring across another number
        of nodes, the ring measured with as many ranks per node across the nearest number of nodes (the
        wider of two as near), with that shape's key, for the plan to scale (dskit/plan/links.py).
        AutoEP's exchange is no ring: only its own shape. None: nothing measured that serves."""
        fits = self.collectives.get(op, {})
        if key in fits:
            return fits[key], key
        per_node, nodes = _shape(key)
        if op not in RING_OPS or nodes < 2:
            return None
        rings = [(n, k) for k in fits for r, n in [_shape(k)] if r == per_node and n > 1]
        if not rings:
            return None
        _, at = min(rings, key=lambda nk: (abs(nk[0] - nodes), -nk[0]))
        return fits[at], at


def load(path: str | Path, *, field: str, gpu: str, fabric: str, procs_per_node: int) -> Calibration:
    """The calibration at `path`, checked against the plan's hardware; SpecError (exit 2) naming
    `field` on anything else."""
    p = Path(path)
    cal = read(p, field=field)
    h = cal.hardware
    for name, theirs, ours in (
        ("gpu", h.gpu, gpu),
        ("fabric", h.fabric, fabric),
        ("procs_per_node", h.procs_per_node, procs_per_node),
    ):
        if theirs != ours:
            raise SpecError(
                field,
                f"{p} was measured with {name} {echo(repr(theirs))}, this plan has {ours!r}: "
                "calibrate this hardware",
            )
    peak = catalog.gpu(gpu, field).peak_tflops_bf16  # the probes run bf16
    for name, rate in (
        ("gemm_tflops", cal.compute.gemm_tflops),
        ("attention_tflops", cal.compute.attention_tflops),
    ):
        if peak is not None and rate is not None and rate > peak * PEAK_MARGIN:
            raise SpecError(
                field,
                f"{p} is damaged at compute.{name}: {rate:.6g} TFLOP/s is above the {gpu} bf16 peak "
                f"({peak:g}, allowed up to {PEAK_MARGIN:g}x for timing noise)",
            )
    return cal


def read(path: str | Path, *, field: str = "calibration") -> Calibration:
    """The calibration at `path`, whatever hardware it names; SpecError naming `field` where it is
    missing, damaged, of another version or not one."""
    p = Path(path)
    try:
        if p.exists() and not p.is_file():
            raise SpecError(field, f"{p} is not a file (give the calibration.json `dskit calibrate` wrote)")
        text = bounded_read.read_bytes(p, limit=MAX_BYTES, what="a calibration").decode("utf-8")
    except FileNotFoundError:
        raise SpecError(field, f"{p} does not exist (run `dskit calibrate` first)") from None
    except bounded_read.TooLarge as e:
        raise SpecError(field, str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(field, f"cannot read {p}: {getattr(e, 'strerror', None) or e}") from None
    try:
        data = bounded_read.parse_json(text, p)
    except bounded_read.TooLarge as e:
        raise SpecError(field, f"{p} is damaged ({e.reason})") from None
    except ValueError as e:  # JSONDecodeError, an integer beyond Python's digit limit
        raise SpecError(field, f"{p} is damaged (not JSON: {str(e)[:80]})") from None
    version = data.get("version") if isinstance(data, dict) else None
    if type(version) is not int or version != VERSION:
        got = version if isinstance(data, dict) else type(data).__name__
        raise SpecError(
            field, f"{p}: calibration version {got!r}, this dskit reads {VERSION}; re-run calibrate"
        )
    try:
        cal = Calibration.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise SpecError(field, f"{p} is damaged at {where}: {err['msg']}") from None
    for op, fits in cal.collectives.items():
        if op not in OPS:
            raise SpecError(
                field, f"{p} is damaged at collectives: {echo(repr(op))} is none of {', '.join(OPS)}"
            )
        bad = next((k for k in fits if not _is_key(k)), None)
        if bad is None:
            bad = next((k for k in fits if _shape(k)[0] > cal.hardware.procs_per_node), None)
        if bad is not None:
            raise SpecError(field, f"{p} is damaged at collectives.{op}: group shape {echo(repr(bad))}")
    return cal


def warning_lines(cal: Calibration) -> list[str]:
    """The file's preflight findings, fit to print."""
    return [echo(w) for w in cal.warnings]


def _is_key(key: str) -> bool:
    return re.fullmatch(SHAPE_KEY, key) is not None


def _shape(key: str) -> tuple[int, int]:
    per_node, nodes = key.split("x")
    return int(per_node), int(nodes)


def echo(text: str) -> str:
    """File text fit for one line of a terminal: escaped, and cut."""
    from dskit.io.text import escape

    text = escape(text)
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "..."


def write(path: str | Path, cal: Calibration) -> None:
    """Atomically: a killed job leaves the previous file (or none), never half of one."""
    write_file(Path(path), json.dumps(cal.model_dump(mode="json"), indent=1) + "\n")


def versions() -> dict[str, Any]:
    """The software the measurement ran on (recorded, not compared)."""
    import torch

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError):
            nccl = None
    driver = None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.split()
            driver = out[0] if out else None
        except (OSError, subprocess.SubprocessError):
            driver = None
    return {"torch": torch.__version__, "nccl": nccl, "driver": driver}
