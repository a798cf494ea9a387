"""ZeRO-3's prefetch limits, chosen so that the overlap the step-time model counts is the overlap the
rendered DeepSpeed config allows.

DeepSpeed 0.19.8 prefetches the next modules' parameters only while fewer than
`stage3_max_live_parameters` are gathered, and at most `stage3_prefetch_bucket_size` of them at a time
(runtime/zero/partitioned_param_coordinator.py `fetch_sub_module`: it prefetches
`min(max_live - available, bucket)`). A layer whose gathered parameters exceed the live limit leaves
no room while it is computed, so nothing of the next layer is fetched ahead: every gather is exposed.
At expert parallelism 8, one DeepSeek-V3 layer's local experts are 1.41 B parameters, over DeepSpeed's
default limit of 1e9. So the limit is raised, where it must be, to the plan's largest gathered layer
plus one prefetch bucket: the room the default leaves smaller models, with which the overlap was
fitted (the bucket stays DeepSpeed's default). The memory model holds two gathered layers
(dskit/plan/memory.py), more than that.
"""

from __future__ import annotations

from typing import Any

from dskit.plan.model_math import ModelCounts

#: DeepSpeed's defaults (runtime/zero/config.py), with which the one-GPU and two-GPU runs were measured
PREFETCH_BUCKET = 5 * 10**7
MAX_LIVE_DEFAULT = 10**9
PERSISTENCE_THRESHOLD = 10**5


def gathered_layer_params(c: ModelCounts, world: int, ep_size: int) -> int:
    """Parameters ZeRO-3 gathers for the largest layer: its non-expert weights, and a MoE layer's local
    experts (1/ep of them) where they are sharded too (the expert-data-parallel group has more than one
    rank)."""
    layer = c.largest_layer
    if world // ep_size > 1:
        layer = max(layer, c.moe_layer_non_expert + c.experts_per_layer // ep_size)
    return layer


def max_live(layer_params: int) -> int:
    """The live limit the plan renders: the layer being computed and one bucket of the next."""
    return max(MAX_LIVE_DEFAULT, layer_params + PREFETCH_BUCKET)


def prefetches(live_limit: int, bucket: int, layer_params: int) -> bool:
    """Whether DeepSpeed fetches the next layer ahead while the largest one is gathered: the live
    limit leaves room for at least one bucket (or the whole next layer, where that is smaller)."""
    return live_limit - layer_params >= min(bucket, layer_params)


def zero3_keys(layer_params: int) -> dict[str, Any]:
    return {
        "stage3_prefetch_bucket_size": PREFETCH_BUCKET,
        "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
        "stage3_max_live_parameters": max_live(layer_params),
        "stage3_max_reuse_distance": MAX_LIVE_DEFAULT,
    }
