"""Which configuration the plan takes: every candidate that fits, ranked by predicted tokens/s.

Candidates are ZeRO stage (3, 2, 1) x EP size x micro-batch (the rest of the per-rank batch is gradient
accumulation) x activation checkpointing (off, every 2nd layer, every layer) x optimizer offload (off,
on; with ZeRO-3 only). Each is checked against
memory (`fit.py`) and timed (`speed.py`); the fastest that fits wins. Near-ties (within SPEED_TIE of
the fastest) go to no offload, then no recomputation, then fewer accumulation steps, then ZeRO-2
over the other stages, then less memory, then the faster: a tie may give up up to SPEED_TIE of predicted speed for these. Offload and recompute
first: offload's rate is not measured here, and the model under-predicted checkpointed runs near
capacity by up to 11% on H200 (bench/results/h200x2-planner-*), so a tie with either is usually a loss.
Then accumulation: the seed post warns that long accumulation hurts MoE convergence, and a bigger
micro-step is the same work in fewer, larger kernels. Then the ZeRO stage: in all 11 pairs measured on
one H200 (bench/results/h200-planner-Z2*-2026-12-01.json beside the ZeRO-3 runs of the same
candidate), ZeRO-2 ran from 1% slower to 21% faster than ZeRO-3, 3% faster in the median, where the model
calls GPU-bound shapes even (ZeRO-3's per-parameter passes and gathered-weight copies, not modelled
apart). ZeRO-1's speed was not measured, so it gets no such preference. Then memory: less of it is less
risk. A plan
with optimizer offload must moreover beat every fitting plan without it by OFFLOAD_MARGIN.

Checkpointing every 2nd layer is searched: on one H200 it ran 10% faster than every layer, within 2% of
its predicted speed and memory (bench/results/h200-ckpt-2026-11-30.json). An earlier run of it five times
slower than every layer sat at 135.6 of ~140 GiB reserved: the allocator retrying near capacity, which
the memory limit keeps plans away from and the trainer now reports (`alloc_retries`). Every 3rd and
beyond are not searched (not measured); a user may set any N (`overrides.activation_checkpointing`).

Where no step time can be predicted (the cpu profile has no peak), or a fitting candidate has a term
left out for an unknown bandwidth (multi-node on `network.fabric: tcp`), the order is the fit order:
ZeRO-3, no offload, the largest EP inside a node, the largest micro-batch, no checkpointing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from dskit.errors import SpecError
from dskit.plan import fit
from dskit.plan.speed import StepTime

#: candidates predicted within this share of the fastest are ties (the model's own error is larger)
SPEED_TIE = 0.03
#: optimizer offload's cost is first principles, not measured here: a plan with it must be predicted
#: faster than every fitting plan without it by more than the step-time model's validated error (15%)
OFFLOAD_MARGIN = 0.15

SpeedOf = Callable[[fit.Candidate], "StepTime | None"]


@dataclass(frozen=True)
class Row:
    fit: fit.Fit
    speed: StepTime | None
    grad_accum: int
    verdict: str  # "chosen", or why it lost

    @property
    def candidate(self) -> fit.Candidate:
        return self.fit.candidate

    @property
    def fits(self) -> bool:
        return self.fit.gpu_ok and self.fit.host_ok


@dataclass(frozen=True)
class Search:
    rows: list[Row]  # chosen first, then the other fitting ones by speed, then those that do not fit
    chosen: Row
    unforced_best: Row | None  # the planner's own pick when overrides narrowed the search; else None

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
        peak = max(f.steady.total_gib, f.construction.total_gib)
        return f"over GPU memory: {peak:.1f} > {f.shape.gpu_limit:.1f} GiB"
    if not f.host_ok:
        return f"over host RAM: {f.host.total_gib:.1f} > {f.shape.host_limit:.1f} GiB/node"
    if fastest is None or row.speed is None or best.speed is None:
        return "fits; an earlier candidate in the fit order won (speed not predicted)"
    d = 1 - row.speed.tokens_per_s / best.speed.tokens_per_s
    speed = f"{abs(d):.0%} {'slower' if d >= 0 else 'faster'} than the winner"
    c, b = row.candidate, best.candidate
    if c.offload and not b.offload and d < 0:
        return f"{speed}, not by the {OFFLOAD_MARGIN:.0%} an unmeasured optimizer offload must win by"
    behind = 1 - row.speed.tokens_per_s / fastest
    if behind > SPEED_TIE:  # outside the tie window, which is measured from the fastest
        return speed if d > 0 else f"{speed}: outside {SPEED_TIE:.0%} of the fastest"
    if c.offload and not b.offload:
        why = "the winner needs no offload"
    elif c.recompute_share > b.recompute_share:
        why = "the winner recomputes less"
    elif row.grad_accum > best.grad_accum:
        why = "the winner accumulates fewer micro-steps"
    elif c.zero_stage != 2 and b.zero_stage == 2:
        why = "the winner is ZeRO-2 (measured 1% slower to 21% faster than ZeRO-3 where predicted even)"
    elif row.fit.steady.total_gib > best.fit.steady.total_gib:
        why = f"the winner needs less memory ({best.fit.steady.total_gib:.1f} GiB)"
    else:
        why = "the winner is faster"
    return f"tie ({speed}; within {SPEED_TIE:.0%} of the fastest): {why}"


def _fastest(rows: list[Row]) -> Row:
    top = max(r.speed.tokens_per_s for r in rows)  # type: ignore[union-attr]
    return min((r for r in rows if r.speed.tokens_per_s >= top * (1 - SPEED_TIE)), key=_rank_key)  # type: ignore[union-attr]


def rank(shape: fit.Shape, candidates: list[fit.Candidate], per_rank: int, speed_of: SpeedOf) -> list[Row]:
    """Every candidate evaluated; the winner first (fits, fastest, tie-broken), then the rest.

    Speed ranks only where every fitting candidate is fully timed: a term left out for an unknown
    bandwidth (network.fabric tcp across nodes) would make the candidates that use it look free, so
    then the fit order decides, as for the cpu profile."""
    rows = [Row(fit.evaluate(shape, c), speed_of(c), per_rank // c.micro_batch, "") for c in candidates]
    ok = [r for r in rows if r.fits]
    if not ok:
        return rows
    fastest = None
    if all(timed(r) for r in ok):
        best = _fastest(ok)
        fastest = max(r.speed.tokens_per_s for r in ok)  # type: ignore[union-attr]
        resident = [r for r in ok if not r.candidate.offload]
        if best.candidate.offload and resident:
            alt = _fastest(resident)
            if alt.speed.tokens_per_s >= best.speed.tokens_per_s * (1 - OFFLOAD_MARGIN):  # type: ignore[union-attr]
                best = alt
        ok.sort(key=lambda r: -r.speed.tokens_per_s)  # type: ignore[union-attr]
    else:
        best = ok[0]  # candidates arrive in the fit order
    rest = [r for r in ok if r is not best] + [r for r in rows if not r.fits]
    best = dataclasses.replace(best, verdict="chosen")
    return [best] + [dataclasses.replace(r, verdict=_verdict(r, best, fastest)) for r in rest]


def search(
    shape: fit.Shape,
    candidates: list[fit.Candidate],
    *,
    unforced: list[fit.Candidate],
    forced: list[str],
    per_rank: int,
    speed_of: SpeedOf,
    ep_for: Callable[[int], int],
) -> Search:
    """The ranked candidates, or SpecError (exit 2) saying why none fits."""
    rows = rank(shape, candidates, per_rank, speed_of)
    free = rank(shape, unforced, per_rank, speed_of) if forced else None
    own = free[0] if free and free[0].fits else None
    if not rows[0].fits:
        field, message = fit.explain_no_fit(
            shape, [r.fit for r in rows], own.candidate if own else None, forced, ep_for
        )
        raise SpecError(field, message)
    unforced_best = own if own is not None and own.candidate != rows[0].candidate else None
    return Search(rows, rows[0], unforced_best)
