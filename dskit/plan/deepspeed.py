"""The DeepSpeed config a plan implies. Pure data: written to deepspeed.json and embedded in run.yaml."""

from __future__ import annotations

from typing import Any

from dskit.plan.memory import REDUCE_BUCKET_ELEMENTS, fused_combine
from dskit.plan.prefetch import zero3_keys
from dskit.plan.schema import HardwarePlan, ModelPlan, OptimPlan, ParallelPlan

# DeepSeek-V2 paper (Sec. 3.1.2): AdamW with beta1 0.9, beta2 0.95.
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8


#: AutoEP's `preset_model` per HF model_type (its router and expert layouts); others use V2's.
AUTOEP_PRESETS = {"deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3"}


def deepspeed_config(
    model: ModelPlan,
    hardware: HardwarePlan,
    parallel: ParallelPlan,
    optim: OptimPlan,
    gathered_layer: int,
) -> dict[str, Any]:
    """The config for the plan's sections; every value comes from them (nothing is decided here).
    `gathered_layer`: the parameters ZeRO-3 gathers for the largest layer (dskit/plan/prefetch.py)."""
    on_gpu, offload_optimizer = hardware.on_gpu, parallel.offload_optimizer
    micro_batch, grad_accum = parallel.micro_batch, parallel.grad_accum
    autoep_preset = AUTOEP_PRESETS.get(model.config.get("model_type"), "deepseek_v2")
    one_rank_zero12 = hardware.world_size == 1 and parallel.zero_stage < 3 and not offload_optimizer
    zero: dict[str, Any] = {
        "stage": parallel.zero_stage,
        # ZeRO-1/2 on one rank has nothing to overlap, and with overlap_comm DeepSpeed synchronises the
        # whole device before each gradient bucket's reduce (stage_1_and_2.allreduce_and_copy): at
        # micro-batch 1 on one H200 the step ran 12% faster without it (bench/results/peer, 2026-12-04).
        # ZeRO-3 (its side streams) and offload (the copies to the host) keep it: measured with it.
        "overlap_comm": on_gpu and not one_rank_zero12,
        "contiguous_gradients": True,
        # Bucket sizes in elements: DeepSpeed's own defaults, written out so run.yaml shows them. The
        # h*h "auto" heuristics of DeepSpeed's HF integration (tuned for dense layers of ~12h^2
        # parameters) cut an MoE layer into hundreds of small collectives, which made each step markedly
        # slower (docs/planner.md "The model's constants and their evidence").
        "reduce_bucket_size": REDUCE_BUCKET_ELEMENTS,
    }
    if parallel.zero_stage == 3:
        zero |= zero3_keys(gathered_layer) | {
            # dskit exports Hugging Face weights itself (`dskit export`): gathering 16-bit weights on save
            # raises NotImplementedError under AutoEP, and costs a full all-gather per checkpoint anyway.
            "stage3_gather_16bit_weights_on_model_save": False,
            # No ZeRO++ or MiCS keys: DeepSpeed 0.19.8 refuses hpZ and qgZ with AutoEP under ZeRO-3, has
            # removed MiCS, and qwZ's quantiser is CUDA-only and unrun here (docs/planner.md "ZeRO
            # stages"; tests/train/test_zeropp.py)
        }
    else:
        # ZeRO-1/2: the updated weights are all-gathered after each step in buckets of this size, and
        # gradients reduce-scattered rather than all-reduced (half the traffic of DeepSpeed's all-reduce)
        zero |= {"allgather_bucket_size": REDUCE_BUCKET_ELEMENTS, "reduce_scatter": True}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * hardware.world_size,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": optim.lr,
                "betas": list(ADAM_BETAS),
                "eps": ADAM_EPS,
                "weight_decay": optim.weight_decay,
            },
        },
        "expert_parallel": {
            "enabled": True,
            "autoep_size": parallel.ep_size,
            "preset_model": autoep_preset,
            # its fused top-k combine where the micro-step is large enough to gain (dskit/plan/memory.py)
            **(
                {"combine_impl": "fused_weighted_sum"}
                if fused_combine(
                    on_gpu, micro_batch * parallel.seq_len, hardware.world_size, parallel.precision
                )
                else {}
            ),
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's ThroughputTimer synchronises the device at each micro-step's start and end (3-4
        # cudaDeviceSynchronize a step, 13.8 ms blocked at seq 2048, micro-batch 1 on an H200:
        # bench/JOURNAL.md); it only feeds steps_per_print's log, which dskit never prints
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }
    if not on_gpu and not offload_optimizer:
        # FusedAdam is a CUDA op; on the CPU accelerator use torch's AdamW. DeepSpeed reads the switch
        # from optimizer.params (engine.get_optimizer_configuration pops it there): one level up it is
        # ignored and DeepSpeed JIT-compiles its CPU FusedAdam instead.
        ds["optimizer"]["params"]["torch_adam"] = True
    if parallel.precision == "bf16":
        ds["bf16"] = {"enabled": True}
        if parallel.optimizer_step == "fused":
            # the fused step skips a non-finite step inside its kernel (dskit/train/fused_step.py); DeepSpeed's
            # check is a max and a min over every gradient and a host sync each step
            ds["bf16"]["check_grad_overflow"] = False
    else:
        # No bf16 (V100, T4): fp16 needs dynamic loss scaling. loss_scale 0 = dynamic; the window is the
        # seed post's growth interval of 2000 steps.
        ds["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 2000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    return ds
