"""The spec's general sections: the model, the hardware and network, the container runtime, the data,
storage, checkpoints and the watchdog. The training section is in dskit/spec/training.py, the planner's
pins in dskit/spec/plan_overrides.py, the target sections in dskit/spec/targets.py; dskit/spec/run_spec.py
joins them into the Spec.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from dskit.data import MIXTURE_BLOCK
from dskit.spec.values import _Section


class ModelSpec(_Section):
    preset: str | None = Field(
        None, description="Catalog model name (see `dskit catalog models`). Default: deepseek-v2-lite."
    )
    path: str | None = Field(
        None,
        description="Local Hugging Face model directory (config.json, optionally *.safetensors to start from) "
        "or a config.json file. Exclusive with preset. Nothing is ever downloaded.",
    )
    num_layers: int | None = Field(
        None, ge=1, description="Keep only the first N decoder layers (smoke tests, benchmarks)."
    )


class HardwareSpec(_Section):
    gpu: str = Field("h100-80gb", description="GPU profile from the catalog (`cpu` for tests and demos).")
    gpus_per_node: int = Field(
        8, ge=1, le=1024, description="GPUs (or, for the cpu profile, processes) per node."
    )
    nodes: int = Field(1, ge=1, le=10000, description="Number of nodes.")
    cpus_per_node: int | None = Field(
        None,
        ge=1,
        description="Host CPU cores per node; sets OMP_NUM_THREADS. Default: 8 per GPU, 1 for cpu.",
    )
    host_memory_gib: float | None = Field(
        None,
        gt=0,
        le=1e6,
        description="Host RAM per node in GiB, checked against optimizer offload and model construction. "
        "Default: the GPU profile's host_memory_gib_per_gpu (its reference node, e.g. DGX H100: 2 TiB / 8) x "
        "gpus_per_node; unknown, so unchecked, for cpu.",
    )
    calibration: str | None = Field(
        None,
        min_length=1,
        description="calibration.json written by `dskit calibrate` on this cluster: the plan then times "
        "collectives and CPU Adam at the rates measured there (docs/planner.md). Default: the catalogs' rates.",
    )


class NetworkSpec(_Section):
    fabric: str = Field("infiniband", description="Network fabric from the catalog.")
    interface: str | None = Field(
        None, description="Socket interface for NCCL/Gloo bootstrap (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)."
    )
    ib_hca: str | None = Field(None, description="NCCL_IB_HCA filter, e.g. 'mlx5_0,mlx5_1' (RDMA fabrics).")


class RuntimeSpec(_Section):
    kind: Literal["pyxis", "apptainer", "none"] = Field(
        "pyxis", description="How Slurm starts the container: pyxis/enroot, apptainer, or none (a bare venv)."
    )
    image: str = Field(
        "dskit:latest",
        min_length=1,
        description="Container image (pyxis: registry ref or .sqsh; apptainer: .sif path). Build it with "
        "`dskit render image`.",
    )
    mounts: list[str] = Field(
        default_factory=list, description="Extra bind mounts 'SRC:DST' (the storage root is always mounted)."
    )
    python: str = Field(
        "python3",
        min_length=1,
        description="Python interpreter inside the runtime (an absolute venv path for none).",
    )


class DataSource(_Section):
    path: str = Field(..., min_length=1, description="Token shard directory from `dskit data prepare`.")
    weight: float = Field(
        ..., gt=0, le=1e6, description="Share of the samples, relative to the other sources."
    )


class DataSpec(_Section):
    sources: list[DataSource] | None = Field(
        None,
        description="A mixture instead of data.path: [{path, weight}, ...]; each sample comes from one source, "
        "in proportion to the weights, deterministically from (seed, sample number). Same tokenizer and kind. "
        "The eval loss reads data.eval_path (the sources' own DIR/eval splits are not mixed).",
    )

    @field_validator("sources")
    @classmethod
    def _some_sources(cls, v: list | None) -> list | None:
        if v is not None and not v:
            raise ValueError("must list at least one {path, weight}, or be left out (use data.path)")
        total = sum(s.weight for s in v or [])
        for i, s in enumerate(v or []):
            if s.weight / total < 1 / MIXTURE_BLOCK:  # Mixture gives it no slot: never sampled
                raise ValueError(
                    f"[{i}].weight {s.weight:g} is below 1/{MIXTURE_BLOCK} of the total {total:g}: that source "
                    f"would never be sampled; raise it or drop the source"
                )
        return v

    path: str | None = Field(
        None,
        description="Token shard directory from `dskit data prepare`. Default: the embedded corpus, "
        "byte-tokenized at start (demo and tests).",
    )
    eval_path: str | None = Field(
        None,
        description="Held-out shard directory for the eval loss. Default: DATA/eval when `data prepare "
        "--eval-fraction` wrote one, else no eval.",
    )
    packing: Literal["pack", "pad"] = Field(
        "pack",
        description="Chat data: 'pack' fills each row with whole samples (attention stays inside each), "
        "'pad' puts one sample per row, each micro-batch only as wide as a bucket of its longest sample. "
        "Text data always uses windows across documents.",
    )


class StorageSpec(_Section):
    root: str = Field(
        "/shared/dskit", min_length=1, description="Shared filesystem root; run dirs go under ROOT/NAME."
    )
    checkpoint_dir: str | None = Field(None, description="Default: ROOT/NAME/checkpoints.")
    output_dir: str | None = Field(None, description="Default: ROOT/NAME/outputs (metrics, exports).")


class CheckpointSpec(_Section):
    every: int = Field(200, ge=1, description="Steps between checkpoints (also saved on SIGUSR1/SIGTERM).")
    keep: int = Field(
        3, ge=1, le=1000, description="Checkpoints kept; older ones are deleted after a good save."
    )
    final: bool = Field(
        True,
        description="Save after the last step (with the probe `dskit export` verifies). Off for benchmarks.",
    )


class WatchdogSpec(_Section):
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=7 * 24 * 3600,
        description="Seconds without a finished step (or eval, or checkpoint save) after which a rank counts "
        "as hung: the job writes the reason and the stuck ranks' stacks to its log and exits 75 to be "
        "restarted from the last checkpoint (or 1, a failure, if it hangs before its first step); collectives "
        "time out 60 s later. Default: the larger of "
        "600 s, 20 predicted steps and 3 predicted checkpoint saves (dskit/plan/hang_timeout.py).",
    )
