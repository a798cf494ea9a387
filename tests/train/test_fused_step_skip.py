"""A non-finite gradient under ZeRO-1/2's fused step (dskit/train/fused_step.py): the step is skipped
inside torch's fused AdamW (its `found_inf`), parameters, moments and step count untouched, and
counted, with DeepSpeed's own bf16 overflow pass switched off as the plan renders it. Real DeepSpeed
ZeRO-2 engine on one CPU rank (gloo), in a subprocess: a process group must not outlive the test."""

import pytest

from tests.support import one_rank

pytestmark = pytest.mark.train

SCRIPT = r"""
import json, math, os, torch, deepspeed
from dskit.train import fused_step

deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)).to(torch.bfloat16)
opt = {"params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
cfg = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2}, "bf16": {"enabled": True, "check_grad_overflow": False},
}
def two_groups(ps):
    # two parameter groups, as the dense and expert groups of a MoE model: a skip is one step, not one per group
    ps = list(ps)
    p = opt["params"]
    return torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:]}], lr=p["lr"], betas=tuple(p["betas"]),
                             eps=p["eps"], weight_decay=p["weight_decay"], fused=True)

engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=two_groups, config=cfg)
assert len(engine.optimizer.bit16_groups) == 2
fused_step.install(engine.optimizer, flat=os.environ["DSKIT_FLAT"] == "1")
x = torch.randn(4, 16, dtype=torch.bfloat16)

def weights():
    return [p.detach().float().clone() for p in engine.module.parameters()]

def adam_steps():
    return sorted(float(s["step"]) for s in engine.optimizer.optimizer.state.values())

out = {}
for name, poison in (("finite", 1.0), ("nan", math.nan), ("inf", math.inf), ("after", 1.0)):
    before, steps = weights(), adam_steps()
    loss = (engine(x).float() * poison).sum()
    engine.backward(loss)
    engine.step()
    out[name] = {
        "moved": max((a - b).abs().max().item() for a, b in zip(weights(), before)),
        "adam_steps_before": steps, "adam_steps_after": adam_steps(),
        "skipped": int(fused_step.skipped_counter(engine)),
        "taken": float(fused_step.step_taken(engine)),  # what the routing bias's update is gated by
    }
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("flat", [False, True], ids=["buckets", "flat"])
def test_a_non_finite_gradient_skips_the_step_on_the_device_and_is_counted(tmp_path, flat):
    """Both gradient paths of one rank: DeepSpeed's buckets, and the flat buffers (dskit/train/flat_grads.py),
    where the non-finite gradient sits in the buffer until the step's zero_grad clears it."""
    r = one_rank.result(one_rank.run(SCRIPT, tmp_path, env={"DSKIT_FLAT": str(int(flat))}))
    assert r["finite"]["moved"] > 0 and r["finite"]["skipped"] == 0
    assert [r[k]["taken"] for k in ("finite", "nan", "inf", "after")] == [1, 0, 0, 1]
    for bad in ("nan", "inf"):  # untouched: weights, and Adam's step count (its moments with it)
        assert r[bad]["moved"] == 0, r
        assert r[bad]["adam_steps_after"] == r[bad]["adam_steps_before"], r
    assert r["nan"]["skipped"] == 1 and r["inf"]["skipped"] == 2
    assert r["after"]["moved"] > 0 and r["after"]["skipped"] == 2  # training goes on
