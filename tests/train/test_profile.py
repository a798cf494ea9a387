"""The profiler's kernel categories, on kernel names as the H200 runs printed them (bench/results)."""

import pytest

from dskit.train.profile import COMMUNICATION, category


@pytest.mark.parametrize(
    "kernel, want",
    [
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "all-to-all (MoE dispatch/combine)"),
        (
            "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "all-gather (ZeRO-3 parameters)",
        ),
        (
            "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "reduce-scatter, all-reduce (gradients)",
        ),
        (
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "reduce-scatter, all-reduce (gradients)",
        ),
        ("gloo:all_to_all", "all-to-all (MoE dispatch/combine)"),
        (
            "ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "communication, other (NCCL/gloo)",
        ),
        ("void at::native::index_elementwise_kernel<128, 4>", "MoE routing (sort, scatter, gather)"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "GEMM"),
        # the fused step's one pass as Inductor names it on the H200, not a copy for its leading `to_copy`
        ("triton_poi_fused__to_copy_add_copy_copy__div_mul_ne_pow_rsub_sqrt_sub_where_0", "optimizer"),
    ],
)
def test_kernels_fall_in_their_category(kernel, want):
    assert category(kernel) == want


def test_collectives_are_matched_before_moe_gathers():
    """'all_gather' contains 'gather': the collective must not be counted as MoE routing."""
    assert category("c10d::all_gather_into_tensor") in COMMUNICATION
