"""ZeRO-3's prefetch limits, and how much of a layer's gather the rendered config lets DeepSpeed fetch
ahead, behind the compute of the layer before it.

DeepSpeed 0.19.8 prefetches the next modules' parameters at every module it fetches, while fewer than
`stage3_max_live_parameters` are gathered, at most `stage3_prefetch_bucket_size` of them per fetch
(runtime/zero/partitioned_param_coordinator.py `fetch_sub_module`: it prefetches
`min(max_live - available, bucket)`, a tensor at a time, refilled at every module). Over a layer's
modules the prefetched volume grows to whatever the live limit leaves beside the layer being computed:
`prefetched_share` of the next layer, which the step-time model (dskit/plan/speed.py) compares, as
gather time, with the compute it runs behind. At DeepSeek-V3's width one layer's local experts at
expert parallelism 8 are 1.41 B parameters, over DeepSpeed's default limit of 1e9: with the default,
nothing of the next layer could be fetched while it is computed. So the limit is raised, where it must
be, to the plan's largest gathered layer plus one prefetch bucket (the bucket stays DeepSpeed's
default): a bucket of the next layer ahead, the rest exposed, as the model counts. Smaller models keep
DeepSpeed's default, with which the one- and two-GPU runs were measured. The memory model holds two
gathered layers (dskit/plan/memory.py), more than that.
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
    """The live limit the plan renders: the layer being computed and one bucket of the next, at least
    DeepSpeed's default."""
    return max(MAX_LIVE_DEFAULT, layer_params + PREFETCH_BUCKET)


def prefetched_share(live_limit: int, layer_params: int) -> float:
    """The share of the next layer DeepSpeed gathers ahead while the largest one is computed: what the
    live limit leaves beside it, at most all of it. The rest is gathered when the layer starts, with
    nothing to hide behind."""
    if layer_params <= 0:
        return 1.0
    return max(0.0, min(1.0, (live_limit - layer_params) / layer_params))


def zero3_keys(layer_params: int) -> dict[str, Any]:
    return {
        "stage3_prefetch_bucket_size": PREFETCH_BUCKET,
        "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
        "stage3_max_live_parameters": max_live(layer_params),
        "stage3_max_reuse_distance": MAX_LIVE_DEFAULT,
    }
