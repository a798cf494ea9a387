"""One rank's ZeRO-1/2 gradients straight into flat buffers (dskit/train/flat_grads.py): the same training
as DeepSpeed's hooks and buckets, with none of them. Real DeepSpeed engines on one CPU rank (gloo), each in a
subprocess: a process group must not outlive the test."""

import pytest

from tests.support import one_rank

pytestmark = pytest.mark.train

SCRIPT = r"""
import json, os, sys, torch, deepspeed
from dskit.train import fused_step

deepspeed.init_distributed(dist_backend="gloo")
flat, stage, overflow_check = sys.argv[1] == "flat", int(sys.argv[2]), sys.argv[3] == "check"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)).to(torch.bfloat16)
opt = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
cfg = {
    # accumulation over 2 micro-steps, and a clip that binds (the norms run 0.15-0.75)
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.1,
    "zero_optimization": {"stage": stage, "overlap_comm": False},
    "bf16": {"enabled": True, "check_grad_overflow": overflow_check},
}
def two_groups(ps):  # as the dense and expert groups of a MoE model
    ps = list(ps)
    return torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:]}], fused=True, **opt)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=two_groups, config=cfg)
try:
    fused_step.install(engine.optimizer, flat=flat)
except TypeError as e:
    print("REFUSED " + str(e))
    sys.exit(0)
g = torch.Generator().manual_seed(1)
losses, norms = [], []
for micro in range(16):
    x = torch.randn(4, 16, generator=g).to(torch.bfloat16)
    loss = (engine(x).float() ** 2).mean()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    if micro % 2:
        norms.append(float(engine.get_global_grad_norm()))
z = engine.optimizer
out = {
    "gradients": fused_step.gradients(engine),
    "losses": losses, "norms": norms,
    "weights": [p.detach().float().flatten().tolist() for p in engine.module.parameters()],
    "hooks": len(z._grad_acc_hooks),
    "bucket_buffers": sum(len(b.buffer) for b in z.ipg_buckets.values()),
}
# a .grad replaced behind the optimizer's back must stop the step, not train without that gradient
next(engine.module.parameters()).grad = None
for _ in range(2):
    engine.backward((engine(x).float() ** 2).mean())
    try:
        engine.step()
    except RuntimeError as e:
        out["replaced"] = str(e)
print("RESULT " + json.dumps(out))
"""


def _run(tmp_path, *args: str) -> dict | str:
    proc = one_rank.run(SCRIPT, tmp_path, *args)
    refused = one_rank.printed(proc, "REFUSED")
    return refused if refused is not None else one_rank.result(proc)


@pytest.mark.parametrize("stage", [2, 1])
def test_flat_gradients_train_as_deepspeeds_buckets_without_hooks_or_buckets(tmp_path, stage):
    flat, buckets = (_run(tmp_path, path, str(stage), "nocheck") for path in ("flat", "buckets"))
    assert (flat["gradients"], buckets["gradients"]) == ("flat", "buckets")
    assert flat["hooks"] == 0 and flat["bucket_buffers"] == 0
    assert buckets["hooks"] > 0  # the path measured against really ran DeepSpeed's hooks
    # bf16 weights and losses the same to the bit; the norm's sum in fp64 instead of fp32 rounds apart
    assert flat["losses"] == buckets["losses"] and flat["weights"] == buckets["weights"]
    assert flat["norms"] == pytest.approx(buckets["norms"], rel=1e-6)
    assert min(flat["norms"]) > 0.1  # the clip bound on every step
    assert "the flat gradient buffers of one rank" in flat["replaced"]


def test_flat_gradients_refuse_deepspeeds_overflow_check_with_its_name(tmp_path):
    why = _run(tmp_path, "flat", "2", "check")
    assert why == (
        "the plan's flat gradients do not run here: DeepSpeed's overflow check (fp16, or bf16 with "
        "check_grad_overflow)"
    )
