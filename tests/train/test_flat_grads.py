"""One rank's ZeRO-1/2 gradients straight into flat buffers (dskit/train/flat_grads.py), added into a zeroed
buffer by autograd or copied there by a hook: the same training as DeepSpeed's hooks and buckets. Real DeepSpeed engines on one CPU rank (gloo), each in a
subprocess: a process group must not outlive the test."""

import pytest

from tests.support import one_rank

pytestmark = pytest.mark.train

SCRIPT = r"""
import json, os, sys, torch, deepspeed
from dskit.train import fused_step

deepspeed.init_distributed(dist_backend="gloo")
path, stage, overflow_check = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "check"
flat, first_write = path != "buckets", path.removeprefix("flat-") if path != "buckets" else "add"
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
    fused_step.install(engine.optimizer, flat=flat, first_write=first_write)
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
    "first_write": fused_step.grad_first_write(engine),
    "dskit_hooks": sum(len(p._post_accumulate_grad_hooks or {}) for p in engine.module.parameters()),
    "losses": losses, "norms": norms,
    "weights": [p.detach().float().flatten().tolist() for p in engine.module.parameters()],
    "hooks": len(z._grad_acc_hooks),
    "bucket_buffers": sum(len(b.buffer) for b in z.ipg_buckets.values()),
}
# a .grad replaced behind the optimizer's back must stop the step, not train without that gradient:
# reassigned after the backward (either landing), or set to None before it (add: autograd then makes a
# new tensor beside the buffer; copy: None is its normal state, so nothing to catch)
first = next(engine.module.parameters())
for tamper in ("reassigned", "none"):
    if tamper == "none" and first_write == "copy":
        continue
    for _ in range(2):
        if tamper == "none":
            first.grad = None
        engine.backward((engine(x).float() ** 2).mean())
        if tamper == "reassigned":
            first.grad = torch.zeros_like(first)
        try:
            engine.step()
        except RuntimeError as e:
            out[f"replaced, {tamper}"] = str(e)
print("RESULT " + json.dumps(out))
"""


def _run(tmp_path, *args: str) -> dict | str:
    proc = one_rank.run(SCRIPT, tmp_path, *args)
    refused = one_rank.printed(proc, "REFUSED")
    return refused if refused is not None else one_rank.result(proc)


@pytest.mark.parametrize("stage, landings", [(2, ["add", "copy"]), (1, ["add"])])
def test_flat_gradients_train_as_deepspeeds_buckets_without_hooks_or_buckets(tmp_path, stage, landings):
    """Each landing (added into a zeroed buffer, copied in by a hook) against DeepSpeed's buckets; the copy
    once, at stage 2 (on one rank stage 1 lays the partition out the same)."""
    buckets = _run(tmp_path, "buckets", str(stage), "nocheck")
    assert buckets["gradients"] == "buckets" and buckets["first_write"] is None
    assert buckets["hooks"] > 0  # the path measured against really ran DeepSpeed's hooks
    for first_write in landings:
        flat = _run(tmp_path, f"flat-{first_write}", str(stage), "nocheck")
        assert (flat["gradients"], flat["first_write"]) == ("flat", first_write)
        assert flat["hooks"] == 0 and flat["bucket_buffers"] == 0
        # copy: one post-accumulate hook per parameter (the 4 of the two Linears), add: none
        assert flat["dskit_hooks"] == {"add": 0, "copy": 4}[first_write]
        # bf16 weights and losses the same to the bit (0 + g is g: a copy lands what an add into zeros
        # does); the norm's sum in fp64 instead of fp32 rounds apart
        assert flat["losses"] == buckets["losses"] and flat["weights"] == buckets["weights"]
        assert flat["norms"] == pytest.approx(buckets["norms"], rel=1e-6)
        assert min(flat["norms"]) > 0.1  # the clip bound on every step
        assert "the flat gradient buffers of one rank" in flat["replaced, reassigned"]
        if first_write == "add":
            assert "set to None or reassigned" in flat["replaced, none"]


def test_flat_gradients_refuse_deepspeeds_overflow_check_with_its_name(tmp_path):
    why = _run(tmp_path, "flat-copy", "2", "check")
    assert why == (
        "the plan's flat gradients do not run here: DeepSpeed's overflow check (fp16, or bf16 with "
        "check_grad_overflow)"
    )


def test_a_copied_gradient_that_did_not_come_this_step_reads_zero_not_last_steps():
    """`copy` zeroes nothing after a step: a parameter no gradient reached (an unused branch) must not keep
    the last step's in its view. A second backward within the step adds, as AccumulateGrad would."""
    import torch

    from dskit.train.flat_grads import _Landing

    a, b = (torch.nn.Parameter(torch.ones(3)) for _ in range(2))
    buffer = torch.zeros(6)
    landing = _Landing({a: buffer[:3], b: buffer[3:]})
    ((a * 2).sum() + (b * 3).sum()).backward()
    landing.settle()
    assert buffer.tolist() == [2.0] * 3 + [3.0] * 3 and a.grad is None and b.grad is None
    landing.written.clear()  # the step's zero_grad
    (a * 5).sum().backward()  # b unused this step
    (a * 1).sum().backward()  # a second backward of the same step
    landing.settle()
    assert buffer.tolist() == [6.0] * 3 + [0.0] * 3


def test_a_hand_edited_landing_that_would_be_ignored_is_refused_by_name():
    """run.yaml edited to `grad_first_write: copy` where the gradients go to DeepSpeed's buckets: refused in
    one line naming the field, not silently run as buckets."""
    from dskit.errors import SpecError
    from dskit.plan.schema import load_plan
    from dskit.train.entry import check_gradients
    from tests.conftest import REPO

    parallel = load_plan(REPO / "slurm/tiny-v2-cpu-venv/run.yaml").parallel
    check_gradients(parallel)  # as rendered
    for edit, field in (
        ({"gradients": "buckets", "grad_first_write": "copy"}, "parallel.grad_first_write"),
        ({"gradients": "flat", "optimizer_step": "deepspeed"}, "parallel.gradients"),
    ):
        with pytest.raises(SpecError) as e:
            check_gradients(parallel.model_copy(update=edit))
        assert e.value.field == field
