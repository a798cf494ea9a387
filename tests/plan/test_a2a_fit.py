"""AutoEP's fixed cost per dispatch-and-combine pair (`bench/a2a_fit.py`, docs/planner.md "Validation on
H200"): speed.py's A2A_PAIR_FIXED_S is what the fit gives on the committed 2 x H200 EP 2 / EP 1 pairs,
so a new run or a change to the model that moves the best value fails here until the constant and its
docs move with it. The fit is the bench script's own, imported."""

from __future__ import annotations

from bench import a2a_fit
from dskit.plan import links, speed


def test_the_fixed_cost_is_the_grids_best_around_the_committed_value():
    rows = a2a_fit.two_gpu_rows()
    pairs = a2a_fit.pairs(rows)
    assert len(pairs) == 5
    fixed, worst = a2a_fit.fit(pairs, near=True)
    assert fixed == speed.A2A_PAIR_FIXED_S
    # the two terms predict what EP 2 costs more than EP 1 better than the one share of the link did
    assert worst < a2a_fit.worst_extra(pairs, share=0.4, fixed=0.0)
    assert links.A2A_LINK_SHARE == 0.8
