"""The log window's records written a step late, as on a GPU (dskit/train/metrics.py `LogWindow`): the
same records as written at their step, each out by the next step or a flush, never lost at the end, and the fused step's skipped count warned about at the record where it grew. One CPU rank (gloo) in
a subprocess: a process group must not outlive the test. A GPU's own timing (CUDA events) is measured by
the benches, not here."""

import pytest

from tests.conftest import render_tiny
from tests.support import one_rank

pytestmark = pytest.mark.train

SCRIPT = r"""
import json, logging, sys
import torch, torch.distributed as dist
from pathlib import Path
from dskit.plan.schema import load_plan
from dskit.train.metrics import LogWindow

dist.init_process_group("gloo")
seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
logging.getLogger("dskit.train").addHandler(Keep())
logging.getLogger("dskit.train").setLevel(logging.INFO)

class Tap:
    # RouterTap's log-step side: the window's expert load and routing-bias figures
    def __init__(self):
        self.n = 0
    def take_load(self):
        self.n += 1
        return torch.tensor([[3.0 * self.n, 1.0], [2.0, 2.0 + self.n]])
    def bias_tensors(self):
        return torch.tensor([0.5 * self.n, 0.25, 0.0])

out = {}
for name, run_yaml in (("now", sys.argv[1]), ("late", sys.argv[2])):
    plan = load_plan(run_yaml)
    w = LogWindow(plan, rank=0, world=1, device=torch.device("cpu"))
    w.deferred = name == "late"
    metrics = Path(plan.run.output_dir) / "metrics.jsonl"
    written = lambda: [json.loads(x)["step"] for x in metrics.read_text().splitlines()] if metrics.exists() else []
    tap, skipped, after = Tap(), torch.zeros((), dtype=torch.int64), {}
    seen.clear()
    for done in range(1, plan.optim.steps + 1):
        w.add(torch.tensor(1.0 / done), torch.tensor(0.01 * done), real_tokens=100 + done, row_tokens=128)
        if done == 4:
            skipped += 1  # the fused step skipped step 4 (in place, while record 3 is on its way)
        w.step_done(done, 1e-3 * done, tap, skipped)
        after[done] = written()
    after["last"] = w.last.get("step")
    w.close()
    after["closed"] = written()
    out[name] = {"after": after, "records": [json.loads(x) for x in metrics.read_text().splitlines()],
                 "warnings": [m for m in seen if "skipped" in m]}
print("RESULT " + json.dumps(out))
"""

#: figures of the host's clock and memory: they differ between two windows fed the same steps
CLOCKED = {
    "tokens_per_s_per_gpu",
    "real_tokens_per_s_per_gpu",
    "mfu",
    "step_time_s",
    "time",
    "peak_alloc_gib",
    "peak_reserved_gib",
}


def test_records_written_a_step_late_are_the_records_written_at_their_step(tmp_path):
    runs = [
        render_tiny(tmp_path, steps=7, name=name, gpus_per_node=1, extra=["training.log_every=3"])
        / "run.yaml"
        for name in ("now", "late")
    ]
    r = one_rank.result(one_rank.run(SCRIPT, tmp_path, *map(str, runs)))
    now, late = r["now"], r["late"]
    # log steps 3, 6 and the last, 7: written at their step, or at the step after (not the next log step)
    after = [[run["after"][str(d)] for d in range(1, 8)] for run in (now, late)]
    assert after[0] == [[], [], [3], [3], [3], [3, 6], [3, 6, 7]]
    assert after[1] == [[], [], [], [3], [3], [3], [3, 6]]
    assert now["after"]["last"] == 7 and late["after"]["last"] == 6
    assert late["after"]["closed"] == [3, 6, 7]  # the last record is not lost at the end
    strip = [
        [{k: v for k, v in rec.items() if k not in CLOCKED} for rec in run["records"]] for run in (now, late)
    ]
    assert strip[0] == strip[1]
    rec6 = strip[1][1]  # steps 4 to 6: mean losses, tokens, this window's load and bias figures
    assert rec6["step"] == 6 and rec6["loss"] == pytest.approx((1 / 4 + 1 / 5 + 1 / 6) / 3)
    # 315 real tokens of 3 steps x global batch 8 x seq 128 on the one rank
    assert rec6["lr"] == pytest.approx(6e-3) and rec6["packing_efficiency"] == round(315 / (3 * 8 * 128), 4)
    assert rec6["expert_counts"] == [[6, 1], [2, 4]] and rec6["expert_bias_spread_per_layer"] == [1.0, 0.25]
    # the skipped step is said once, with the record of the window it fell in
    for run in (now, late):
        assert run["warnings"] == [
            "1 optimizer step(s) skipped by step 6: the gradient norm was not finite (inf or NaN); "
            "the weights and optimizer states were left as they were"
        ], run["warnings"]
