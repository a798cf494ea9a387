"""Which configuration the plan takes: every candidate that fits, ranked by predicted tokens/s.

Candidates are ZeRO stage (3, 2, 1) x EP size x micro-batch (the rest of the per-rank batch is gradient
accumulation) x activation checkpointing (off, every 2nd layer, every layer) x optimizer offload (off,
on; with ZeRO-3 only). Each is checked against memory (`fit.py`) and timed (`speed.py`); the fastest
that fits wins.

Near-ties (within SPEED_TIE of the fastest, the model's own error) are broken by risk, in this order
(`_rank_key`): no offload, then no recomputation, then fewer accumulation steps, then ZeRO-2 over the
other stages, then less memory, then the faster. Offload and recompute come first because their terms
are the least certain (offload's host rate was fitted on one machine; checkpointed runs near capacity
were predicted fast). Accumulation next: long accumulation hurts MoE convergence, and a bigger
micro-step is the same work in fewer, larger kernels. ZeRO-2 next, because where the model called
ZeRO-2 and ZeRO-3 even, ZeRO-2 measured as fast or faster; ZeRO-2 over ZeRO-1 has only history behind
it (ZeRO-1 and ZeRO-2 measured within the tie either way). Then memory: less of it is less risk. A plan
with optimizer offload must moreover be predicted more than OFFLOAD_MARGIN faster than every fitting
plan without it (`offload_wins`). The measurements behind each rule: docs/planner.md.

Checkpointing every 2nd layer is searched because it measured faster than every layer at the same
predicted accuracy; every 3rd and beyond are not searched (not measured); a user may set any N
(`overrides.activation_checkpointing`).

Where no step time can be predicted (the cpu profile without a calibration's GEMM rate), or a fitting candidate has a term
left out for an unknown bandwidth (multi-node on `network.fabric: tcp`, uncalibrated), the order is the
fit order: ZeRO-3, no offload, the largest EP inside a node, the largest micro-batch, no checkpointing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from dskit.calibrate.calibration import Calibration
from dskit.errors import SpecError
from dskit.plan import fit
from dskit.plan.candidate import Candidate
from dskit.plan.speed import StepTime
from dskit.spec.plan_overrides import GPU_MEMORY_MIN_MARGIN

#: candidates predicted within this share of the fastest are ties (the model's own error is larger)
SPEED_TIE = 0.03
#: optimizer offload's CPU Adam rate was fitted on one host's cores only and is scaled to others by their
#: cores (docs/planner.md "Optimizer offload, measured"): a plan with it must be predicted faster than
#: every fitting plan without it by more than the step-time model's validated error (`offload_wins`)
OFFLOAD_MARGIN = 0.15

SpeedOf = Callable[[Candidate], "StepTime | None"]

# ---- the candidates: each dimension in the fit order ----
#: ZeRO stages searched (3 first: the path every plan took before stages 1 and 2)
ZERO_STAGES = (3, 2, 1)
#: the stages an FP8 frozen base trains under: its Fp8Linear buffers and FP8 expert originals are never
#: partitioned by ZeRO-3 (buffers are whole on every rank; float8 parameters it cannot gather on gloo)
FP8_BASE_STAGES = (2, 1)
#: optimizer offload searched: off, on (with ZeRO-3 only: `offload_with`)
OFFLOADS = (False, True)
#: activation checkpointing searched: off, every 2nd layer, every layer (why not every 3rd and beyond:
#: the module docstring)
CKPT_EVERY_CHOICES = (0, 2, 1)
#: micro-batches searched, largest first: powers of two (a pinned one may be any value that splits the
#: per-rank batch: `micro_batch_splits`)
MICRO_BATCHES = (64, 32, 16, 8, 4, 2, 1)
CPU_MAX_MICRO_BATCH = 8  # CPU runs: a small micro-batch keeps 2-core test machines responsive
#: a micro-batch refusal lists every valid value up to this many, else the smallest and largest few
_LIST_AT_MOST = 12
#: values tried from below for that list (their cofactors give the large ones): bounds the refusal's cost
_SCAN = 100_000


def ep_divides(n_experts: int, world: int, ep: int) -> bool:
    """The EP sizes AutoEP takes: groups that hold whole experts and tile the world."""
    return n_experts % ep == 0 and world % ep == 0


def ep_tiles_nodes(ep: int, per_node: int) -> bool:
    """EP groups (consecutive ranks) that fill whole nodes or sit inside one, so every group has one
    shape (dskit/plan/links.py): EP divides the ranks per node, or is a multiple of them."""
    return per_node % ep == 0 or ep % per_node == 0


def ep_sizes(n_experts: int, world: int, per_node: int) -> list[int]:
    """Every EP size AutoEP takes, in the fit order: inside a node, largest first (the all-to-all runs
    on NVLink), then across nodes, where it runs over the fabric."""
    every = [
        d
        for d in range(1, math.gcd(n_experts, world) + 1)
        if ep_divides(n_experts, world, d) and ep_tiles_nodes(d, min(per_node, world))
    ]
    return sorted((d for d in every if d <= per_node), reverse=True) + [d for d in every if d > per_node]


def default_ep(n_experts: int, world: int, per_node: int) -> int:
    """The fit order's first EP size: the largest inside a node."""
    return ep_sizes(n_experts, world, per_node)[0]


def offload_with(zero_stage: int) -> bool:
    """Optimizer offload is searched with ZeRO-3 only: its host-memory and speed terms are stage 3's."""
    return zero_stage == 3


def micro_batch_splits(per_rank: int, micro_batch: int) -> bool:
    """What a micro-batch must meet: whole micro-steps (grad_accum = per_rank / micro_batch). A pinned
    one is taken if it does; whether it fits in memory is the search's to say."""
    return per_rank % micro_batch == 0


def micro_batches(per_rank: int, on_cpu: bool) -> list[int]:
    """The micro-batches the planner searches on its own, largest first."""
    return [
        m
        for m in MICRO_BATCHES
        if micro_batch_splits(per_rank, m) and (not on_cpu or m <= CPU_MAX_MICRO_BATCH)
    ]


def valid_micro_batches(per_rank: int) -> str:
    """The values `micro_batch_splits` accepts for `per_rank`, for a refusal: each one is checked by
    that rule (no second definition of valid), listed whole when short, else described compactly."""
    root = math.isqrt(per_rank)
    small = [m for m in range(1, min(root, _SCAN) + 1) if micro_batch_splits(per_rank, m)]
    large = [per_rank // m for m in reversed(small) if micro_batch_splits(per_rank, per_rank // m)]
    if root > _SCAN:  # the middle was not searched: name the rule and the ends found
        return f"the divisors of {per_rank}, e.g. {', '.join(map(str, [*small[:4], '...', *large[-2:]]))}"
    valid = sorted(set(small + large))
    if len(valid) <= _LIST_AT_MOST:
        return ", ".join(map(str, valid))
    ends = [*map(str, valid[:6]), "...", *map(str, valid[-3:])]
    return f"the {len(valid)} divisors of {per_rank}: {', '.join(ends)}"


@dataclass(frozen=True)
class Axes:
    """The search's dimensions, each in the fit order; an override pins one to its value."""

    offloads: tuple[bool, ...]
    eps: tuple[int, ...]
    micro_batches: tuple[int, ...]
    ckpts: tuple[int, ...]
    stages: tuple[int, ...]

    def candidates(self) -> list[Candidate]:
        """Every combination, in the fit order (used where no speed is predicted): ZeRO-3, no offload
        first, largest EP inside a node, largest micro-batch, no checkpointing."""
        return [
            Candidate(ep, mb, ck, off, st)
            for st in self.stages
            for off in self.offloads
            if not off or offload_with(st)
            for ep in self.eps
            for mb in self.micro_batches
            for ck in self.ckpts
        ]


def axes(setting: fit.Setting, per_rank: int, *, weighs: bool = True) -> Axes:
    """Every choice the planner weighs on its own. Where no step time can be predicted (`weighs`
    False: CPU ranks without a calibration's measured compute rate) there is nothing to weigh EP sizes
    and stages by: it takes the fit order's first of each."""
    on_cpu = setting.gpu.is_cpu
    eps = ep_sizes(setting.work.shape.routed_experts, setting.world, setting.per_node)
    # an FP8 base trains under ZeRO-1/2 only (docs/planner.md "LoRA"): its FP8 layers are not partitioned
    stages = ZERO_STAGES if setting.tuning is None or not setting.tuning.fp8 else FP8_BASE_STAGES
    return Axes(
        offloads=OFFLOADS,
        eps=tuple(eps if weighs else eps[:1]),
        micro_batches=tuple(micro_batches(per_rank, on_cpu)),
        ckpts=CKPT_EVERY_CHOICES,
        stages=stages if weighs else stages[:1],
    )


@dataclass(frozen=True)
class Row:
    fit: fit.Fit
    speed: StepTime | None
    grad_accum: int
    verdict: str  # "chosen", or why it lost

    @property
    def candidate(self) -> Candidate:
        return self.fit.candidate

    @property
    def fits(self) -> bool:
        return self.fit.gpu_ok and self.fit.host_ok


@dataclass(frozen=True)
class Search:
    rows: list[Row]  # chosen first, then the other fitting ones by speed, then those that do not fit
    chosen: Row
    unforced_best: Row | None  # the planner's own pick when overrides narrowed the search; else None
    calibration: Calibration | None = None  # what the rows' speeds were predicted from (`--explain`)
    # the chosen candidate with the other choice of training.fp8, and what that choice is (`--explain`)
    precision_alternative: tuple[str, StepTime | None] | None = None

    @property
    def forced_cost(self) -> float | None:
        """How much slower the overrides' pick is predicted than the planner's own (0.12 = 12%)."""
        a, b = self.chosen.speed, self.unforced_best.speed if self.unforced_best else None
        if a is None or b is None:
            return None
        return 1 - a.tokens_per_s / b.tokens_per_s


def _rank_key(row: Row) -> tuple:
    """The tie order: no offload, no recompute, fewer accumulation steps, less memory, then speed."""
    c, s = row.candidate, row.speed
    return (
        c.offload,
        c.recompute_share,
        row.grad_accum,
        c.zero_stage != 2,
        row.fit.steady.total_gib,
        -s.tokens_per_s if s else 0.0,
    )


def timed(row: Row) -> bool:
    """A prediction that counts every term (no bandwidth was unknown)."""
    return row.speed is not None and not row.speed.unknown


def _verdict(row: Row, best: Row, fastest: float | None) -> str:
    f = row.fit
    if not f.gpu_ok:
        return f"over GPU memory: {f.peak_gib:.1f} > {f.setting.gpu_limit:.1f} GiB"
    if not f.host_ok:
        return f"over host RAM: {f.host.total_gib:.1f} > {f.setting.host_limit:.1f} GiB/node"
    if fastest is None or row.speed is None or best.speed is None:
        return "fits; an earlier candidate in the fit order won (speed not predicted)"
    d = 1 - row.speed.tokens_per_s / best.speed.tokens_per_s
    speed = f"{abs(d):.0%} {'slower' if d >= 0 else 'faster'} than the winner"
    c, b = row.candidate, best.candidate
    if c.offload and not b.offload and d < 0:
        return (
            f"{speed}, not more than the {OFFLOAD_MARGIN:.0%} an optimizer offload must win by "
            "(its host rate is extrapolated)"
        )
    behind = 1 - row.speed.tokens_per_s / fastest
    if behind > SPEED_TIE:  # outside the tie window, which is measured from the fastest
        return speed if d > 0 else f"{speed}: outside {SPEED_TIE:.0%} of the fastest"
    if c.offload and not b.offload:
        why = "the winner needs no offload"
    elif c.recompute_share > b.recompute_share:
        why = "the winner recomputes less"
    elif row.grad_accum > best.grad_accum:
        why = "the winner accumulates fewer micro-steps"
    elif c.zero_stage == 3 and b.zero_stage == 2:
        why = "the winner is ZeRO-2 (measured 1% slower to 21% faster than ZeRO-3 where predicted even)"
    elif c.zero_stage == 1 and b.zero_stage == 2:
        why = "the winner is ZeRO-2, the tie's order (measured within 4.1% of ZeRO-1 either way on one GPU)"
    elif row.fit.steady.total_gib > best.fit.steady.total_gib:
        why = f"the winner needs less memory ({best.fit.steady.total_gib:.1f} GiB)"
    else:
        why = "the winner is faster"
    return f"tie ({speed}; within {SPEED_TIE:.0%} of the fastest): {why}"


def over_the_margin_only(rows: list[Row], chosen: Row) -> Row | None:
    """Of the candidates that miss the GPU limit but would fit with GPU_MEMORY_MIN_MARGIN, their host
    RAM fitting, predicted more than OFFLOAD_MARGIN faster than `chosen`: the one needing the least memory,
    what the largest smaller overrides.gpu_memory_margin takes (None where there is none)."""
    usable = chosen.fit.setting.gpu.usable_memory_gib
    if chosen.speed is None or usable is None:
        return None
    room = usable * (1 - GPU_MEMORY_MIN_MARGIN)
    near = [
        r
        for r in rows
        if not r.fit.gpu_ok
        and r.fit.host_ok
        and timed(r)
        and r.fit.peak_gib <= room
        and r.speed.tokens_per_s > chosen.speed.tokens_per_s * (1 + OFFLOAD_MARGIN)  # type: ignore[union-attr]
    ]
    return min(near, key=lambda r: r.fit.peak_gib, default=None)


def offload_wins(offload: StepTime, resident: StepTime) -> bool:
    """The one offload rule (code, --explain and docs/planner.md): a plan with optimizer offload is taken
    only where it is predicted more than OFFLOAD_MARGIN faster than the fastest fitting plan without it."""
    return offload.tokens_per_s > resident.tokens_per_s * (1 + OFFLOAD_MARGIN)


def pick(rows: list[Row]) -> Row:
    """The winner among fitting, fully timed rows: the fastest (tie-broken), unless it offloads and does
    not win by OFFLOAD_MARGIN over the fastest resident row."""
    best = _fastest(rows)
    resident = [r for r in rows if not r.candidate.offload]
    if best.candidate.offload and resident:
        alt = _fastest(resident)
        if not offload_wins(best.speed, alt.speed):  # type: ignore[arg-type]
            best = alt
    return best


def _fastest(rows: list[Row]) -> Row:
    top = max(r.speed.tokens_per_s for r in rows)  # type: ignore[union-attr]
    return min((r for r in rows if r.speed.tokens_per_s >= top * (1 - SPEED_TIE)), key=_rank_key)  # type: ignore[union-attr]


def rank(setting: fit.Setting, candidates: list[Candidate], speed_of: SpeedOf) -> list[Row]:
    """Every candidate evaluated; the winner first (fits, fastest, tie-broken), then the rest.

    Speed ranks only where every fitting candidate is fully timed: a term left out for an unknown
    bandwidth (network.fabric tcp across nodes) would make the candidates that use it look free, so
    then the fit order decides, as for the cpu profile."""
    rows = [Row(fit.evaluate(setting, c), speed_of(c), setting.grad_accum(c), "") for c in candidates]
    ok = [r for r in rows if r.fits]
    if not ok:
        return rows
    fastest = None
    if all(timed(r) for r in ok):
        best = pick(ok)
        fastest = max(r.speed.tokens_per_s for r in ok)  # type: ignore[union-attr]
        ok.sort(key=lambda r: -r.speed.tokens_per_s)  # type: ignore[union-attr]
    else:
        best = ok[0]  # candidates arrive in the fit order
    rest = [r for r in ok if r is not best] + [r for r in rows if not r.fits]
    best = dataclasses.replace(best, verdict="chosen")
    return [best] + [dataclasses.replace(r, verdict=_verdict(r, best, fastest)) for r in rest]


def search(
    setting: fit.Setting,
    pinned: Axes,
    *,
    free: Axes,
    forced: list[str],
    speed_of: SpeedOf,
    ep_for: Callable[[int], list[int]],
) -> Search:
    """The ranked candidates of `pinned` (`free` narrowed by the overrides named in `forced`), or
    SpecError (exit 2) saying why none fits. With overrides, `free` is ranked too: the planner's own
    pick, to name a slower forced choice and to tell a bad override from a small cluster."""
    rows = rank(setting, pinned.candidates(), speed_of)
    free_rows = rank(setting, free.candidates(), speed_of) if forced else None
    own = free_rows[0] if free_rows and free_rows[0].fits else None
    if not rows[0].fits:
        field, message = fit.explain_no_fit(
            setting, [r.fit for r in rows], own.candidate if own else None, forced, ep_for
        )
        raise SpecError(field, message)
    unforced_best = own if own is not None and own.candidate != rows[0].candidate else None
    return Search(rows, rows[0], unforced_best)
