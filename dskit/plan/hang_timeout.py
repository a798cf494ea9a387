"""How long a rank may go without progress before the watchdog calls it hung (dskit/train/watchdog.py).

The longest gap between two beats of a healthy rank is a step (the first one carries compiles), an
eval, or a checkpoint save. The default covers each with a wide margin and never goes below the NCCL
collective timeout that GPU jobs already live with, so nothing that works today is taken for a hang:

    timeout = max(FLOOR_S, STEP_MARGIN x predicted step, SAVE_MARGIN x predicted save)

The process group's collective timeout is the same number plus COLLECTIVE_GRACE_S (dskit/launch/contract.py):
the watchdog fires first and names the rank that stopped; the collective timeout is the backstop for a
rank whose watchdog thread cannot run (a C call holding the GIL), and it too ends in a restart.
"""

from __future__ import annotations

#: torch's default collective timeout for NCCL (torch.distributed.constants.default_pg_nccl_timeout,
#: 10 minutes): a GPU job today already fails when one collective waits longer.
FLOOR_S = 600.0
#: Steps vary (an eval, a slow node, the first step's torch.compile: 15-16 s cold on H200, see
#: bench/README.md): a rank is hung only when it misses many steps' worth of time.
STEP_MARGIN = 20
#: A checkpoint's write time varies with the filesystem's load.
SAVE_MARGIN = 3
#: Bytes a ZeRO checkpoint holds per parameter: the fp32 master weight and Adam's two fp32 moments
#: (12, DeepSpeed's optimizer-state files) and, to spare, a 16-bit weight (2). Measured: 12.4 for the
#: tiny CPU model's ZeRO-3 checkpoint (optimizer states 12.06, the rest RNG state and metadata).
CHECKPOINT_BYTES_PER_PARAM = 14
#: Write rate per node to the shared checkpoint filesystem, on the slow side: one 10 GbE NFS client
#: (about 1.1 GB/s at line rate). Parallel filesystems write faster, which only adds margin.
WRITE_BYTES_PER_S_PER_NODE = 1e9


def predicted_save_s(params_total: int, nodes: int) -> float:
    """Seconds to write one checkpoint when every node writes its share at WRITE_BYTES_PER_S_PER_NODE."""
    return params_total * CHECKPOINT_BYTES_PER_PARAM / (nodes * WRITE_BYTES_PER_S_PER_NODE)


def derived_timeout_s(*, step_s: float | None, params_total: int, nodes: int) -> float:
    """The default `watchdog.timeout_s`; `step_s` is the plan's predicted step (None: not predicted,
    as on the cpu profile: the floor and the save time decide)."""
    return round(
        max(FLOOR_S, STEP_MARGIN * (step_s or 0.0), SAVE_MARGIN * predicted_save_s(params_total, nodes)), 1
    )


def watchdog_timeout_s(
    forced: float | None, *, step_s: float | None, params_total: int, nodes: int, warnings: list[str]
) -> float:
    """The spec's `watchdog.timeout_s`, or the derived default; a forced value under the default warns."""
    derived = derived_timeout_s(step_s=step_s, params_total=params_total, nodes=nodes)
    if forced is None:
        return derived
    if forced < derived:
        warnings.append(
            f"watchdog.timeout_s={forced:g} is below the derived {derived:g} s (the larger of {FLOOR_S:g} s, "
            f"{STEP_MARGIN} predicted steps and {SAVE_MARGIN} predicted checkpoint saves): a slow step or "
            "save may be taken for a hung rank and restart the job"
        )
    return float(forced)
