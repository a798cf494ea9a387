"""Run under torchrun on 2 gloo ranks by tests/train/test_fp8_lora.py: does DeepSpeed ZeRO-3 partition and
gather a frozen float8 parameter (what an FP8 base under ZeRO-3 would need)? Prints what it saw."""

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

CFG = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}

deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
torch.manual_seed(0)
w8 = torch.randn(300, 200).to(torch.float8_e4m3fn)
with deepspeed.zero.Init(config_dict_or_path=CFG, dtype=torch.bfloat16):  # as dskit builds under ZeRO-3
    model = nn.Sequential(nn.Linear(200, 4, dtype=torch.bfloat16))
model.w = nn.Parameter(w8.clone(), requires_grad=False)  # then swapped in FP8, frozen
# torch's AdamW, as dskit configures it on CPU ranks (dskit/plan/deepspeed.py): DeepSpeed's CPU FusedAdam
# would be JIT-compiled first, about 100 s on 2 cores in a fresh CI run
optimizer = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
engine, *_ = deepspeed.initialize(
    model=model, model_parameters=list(model[0].parameters()), config={**CFG, "optimizer": optimizer}
)
p = engine.module.w
print(f"rank {rank} partition {p.ds_tensor.dtype} {p.ds_tensor.numel()}", flush=True)
try:
    with deepspeed.zero.GatheredParameters([p]):
        same = torch.equal(p.data.view(torch.uint8), w8.view(torch.uint8))
    print(f"rank {rank} gathered {'equal' if same else 'DIFFERENT'}", flush=True)
except RuntimeError as e:
    print(f"rank {rank} gather failed: {str(e).splitlines()[0]}", flush=True)
