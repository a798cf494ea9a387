"""AutoEP's fixed cost per dispatch-and-combine pair (`dskit/plan/speed.py` A2A_PAIR_FIXED_S), fitted
from the committed 2 x H200 runs (docs/planner.md "Validation on H200"): what EP 2 cost more per step
than EP 1 at the same configuration and micro-batch, measured against today's plan
(`plan_bench.repredict`); the grid value with the smallest worst relative error of that difference over
the pairs, every other constant at speed.py's value. The difference holds the all-to-all and little
else (the rest of the two plans' errors cancel in it), where an EP 2 run's own error is dominated by
terms the all-to-all does not touch. The bytes are not fitted: they run at the catalog's all-to-all
rate, NCCL's share of NVLink (`dskit/plan/links.py` A2A_LINK_SHARE, cited there).

The tables set each pair, and each EP 2 run's tokens/s, beside the model before (one share of the
link, 0.4, fitted on these runs, no fixed cost: for a group inside one node the same as
A2A_LINK_SHARE = 0.4 and A2A_PAIR_FIXED_S = 0) and after. `--check` (tests/plan/test_a2a_fit.py): the
grid only around speed.py's value; exits 1 where the fit differs from it.

    python bench/a2a_fit.py --out bench/results/planner/model-a2a-fit-2026-12-05.json
    python bench/a2a_fit.py --check
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import plan_bench, runs  # noqa: E402
from dskit.plan import links, speed  # noqa: E402

#: seconds per pair, on a 0.25 ms grid
GRID = tuple(round(0.00025 * i, 5) for i in range(25))
#: the model before: one share of the link for everything, no fixed cost
BEFORE = {"A2A_LINK_SHARE": 0.4, "A2A_PAIR_FIXED_S": 0.0}


def two_gpu_rows() -> list[dict]:
    """The 2 x H200 planner runs that ran the plan's own kernels (as bench/optimizer_refit.py reads them)."""
    rows = plan_bench.load_rows(runs.results("planner"))
    return [r for r in rows if r["gpus"] == 2 and "attention_ran" not in r]


def _o(r: dict) -> dict:
    return dict(x.split("=", 1) for x in plan_bench.forced_overrides(r))


def ep(r: dict) -> int:
    return int(_o(r)["overrides.ep_size"])


def _predict(r: dict, share: float, fixed: float) -> dict:
    with runs.patched(links, A2A_LINK_SHARE=share), runs.patched(speed, A2A_PAIR_FIXED_S=fixed):
        return plan_bench.repredict(r)[0]


def error(r: dict, share: float, fixed: float) -> float:
    """Predicted over measured tokens/s, less 1."""
    return _predict(r, share, fixed)["tokens_per_s_per_gpu"] / r["measured"]["tokens_per_s_per_gpu"] - 1


def worst(rows: list[dict], share: float, fixed: float) -> float:
    return max(abs(error(r, share, fixed)) for r in rows)


def pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """Each EP 2 run with the EP 1 run of its configuration and micro-batch, where one ran."""
    ep1: dict[tuple, dict] = {}
    for r in rows:
        if ep(r) == 1:
            ep1.setdefault(_key(r), r)
    return [(r, ep1[_key(r)]) for r in rows if ep(r) == 2 and _key(r) in ep1]


def extra_s(pair: tuple[dict, dict], share: float, fixed: float) -> float:
    """The predicted step of the EP 2 run less its EP 1 run's."""
    two, one = pair
    return _predict(two, share, fixed)["step_s"] - _predict(one, share, fixed)["step_s"]


def measured_extra_s(pair: tuple[dict, dict]) -> float:
    return pair[0]["measured"]["step_s"] - pair[1]["measured"]["step_s"]


def worst_extra(ps: list[tuple[dict, dict]], share: float, fixed: float) -> float:
    return max(abs(extra_s(p, share, fixed) / measured_extra_s(p) - 1) for p in ps)


def fit(ps: list[tuple[dict, dict]], near: bool = False) -> tuple[float, float]:
    """(the fixed cost with the smallest worst relative error of the pairs' extra step time, that
    error); a tie keeps the smaller."""
    grid = GRID
    if near:
        i = min(range(len(GRID)), key=lambda k: abs(GRID[k] - speed.A2A_PAIR_FIXED_S))
        grid = GRID[max(0, i - 1) : i + 2]
    best = None
    for f in grid:
        e = worst_extra(ps, links.A2A_LINK_SHARE, f)
        if best is None or e < best[1] - 1e-12:
            best = (f, e)
    assert best is not None
    return best


def _key(r: dict) -> tuple:
    o = _o(r)
    return (
        r["config"],
        o["overrides.micro_batch"],
        o["overrides.activation_checkpointing"],
        o["overrides.compile"],
    )


def table(rows: list[dict]) -> dict:
    """Each EP 2 run's step and error before and after, and each pair's extra step time."""
    before, after = _as_args(BEFORE), {"share": links.A2A_LINK_SHARE, "fixed": speed.A2A_PAIR_FIXED_S}
    out = []
    for r in rows:
        if ep(r) != 2:
            continue
        b, a = _predict(r, **before), _predict(r, **after)
        meas = r["measured"]["tokens_per_s_per_gpu"]
        out.append(
            {
                "config": r["config"],
                "micro_batch": int(_o(r)["overrides.micro_batch"]),
                "measured_step_s": r["measured"]["step_s"],
                "before_step_s": round(b["step_s"], 4),
                "before_all_to_all_s": round(b["all_to_all_s"], 4),
                "before_error": round(b["tokens_per_s_per_gpu"] / meas - 1, 4),
                "after_step_s": round(a["step_s"], 4),
                "after_all_to_all_s": round(a["all_to_all_s"], 4),
                "after_error": round(a["tokens_per_s_per_gpu"] / meas - 1, 4),
            }
        )
    extra = [
        {
            "config": p[0]["config"],
            "micro_batch": int(_o(p[0])["overrides.micro_batch"]),
            "measured_extra_s": round(measured_extra_s(p), 4),
            "before_extra_s": round(extra_s(p, **before), 4),
            "after_extra_s": round(extra_s(p, **after), 4),
        }
        for p in pairs(rows)
    ]
    return {"runs": out, "ep2_minus_ep1": extra}


def _as_args(c: dict) -> dict:
    return {"share": c["A2A_LINK_SHARE"], "fixed": c["A2A_PAIR_FIXED_S"]}


def markdown(t: dict) -> str:
    lines = [
        "| configuration | mb | measured s | before s (a2a) | before err | after s (a2a) | after err |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in t["runs"]:
        lines.append(
            f"| {x['config']} | {x['micro_batch']} | {x['measured_step_s']:.3f} | {x['before_step_s']:.3f}"
            f" ({x['before_all_to_all_s'] * 1e3:.1f} ms) | {x['before_error']:+.1%} | {x['after_step_s']:.3f}"
            f" ({x['after_all_to_all_s'] * 1e3:.1f} ms) | {x['after_error']:+.1%} |"
        )
    lines += [
        "",
        "| configuration | mb | EP 2 step less EP 1 measured | before | after |",
        "|---|---|---|---|---|",
    ]
    for x in t["ep2_minus_ep1"]:
        lines.append(
            f"| {x['config']} | {x['micro_batch']} | {x['measured_extra_s'] * 1e3:+.1f} ms"
            f" | {x['before_extra_s'] * 1e3:+.1f} ms | {x['after_extra_s'] * 1e3:+.1f} ms |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="JSON file to write")
    ap.add_argument(
        "--check", action="store_true", help="the grid only around speed.py's value; exit 1 if it differs"
    )
    a = ap.parse_args()
    rows = two_gpu_rows()
    ps = pairs(rows)
    ep2 = [r for r in rows if ep(r) == 2]
    fixed, err = fit(ps, a.check)
    before = worst_extra(ps, **_as_args(BEFORE))
    print(
        f"A2A_PAIR_FIXED_S fitted {fixed * 1e3:g} ms (speed.py {speed.A2A_PAIR_FIXED_S * 1e3:g} ms) at"
        f" A2A_LINK_SHARE {links.A2A_LINK_SHARE:g}: worst error of EP 2's extra step time {err:.1%} over"
        f" {len(ps)} EP 2 / EP 1 pairs; before (share 0.4, no fixed cost) {before:.1%}"
    )
    if a.check:
        sys.exit(0 if fixed == speed.A2A_PAIR_FIXED_S else 1)
    t = table(rows)
    print()
    print(markdown(t))
    if a.out:
        head = {
            **runs.model_header(
                "none: dskit plan's step-time model over the committed 2 x H200 planner runs"
            ),
        }
        body = {
            "fit": {
                "A2A_PAIR_FIXED_S": fixed,
                "scored_on": "EP 2's extra step time over EP 1, measured against predicted",
                "worst_error": round(err, 4),
                "pairs": len(ps),
                "A2A_LINK_SHARE": links.A2A_LINK_SHARE,
                "grid_s": list(GRID),
                "before": {**BEFORE, "worst_error": round(before, 4)},
                "ep2_runs_worst_tokens_error": {
                    "before": round(worst(ep2, **_as_args(BEFORE)), 4),
                    "after": round(worst(ep2, links.A2A_LINK_SHARE, fixed), 4),
                },
            },
            **t,
        }
        a.out.write_text(json.dumps({**head, **body}, indent=1) + "\n")
    sys.exit(0 if fixed == speed.A2A_PAIR_FIXED_S else 1)


if __name__ == "__main__":
    main()
