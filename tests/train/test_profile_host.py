"""The host's side of a profile: what a step's CUDA runtime calls and synchronisations cost (the
tables bench/peer_bench.py prints for dskit and torchtitan)."""

from dskit.train.profile import host_table


def _x(cat: str, name: str, dur_us: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": 0, "dur": dur_us}


def test_launches_syncs_and_blocked_time_are_counted_per_step():
    events = [
        *[_x("cuda_runtime", "cudaLaunchKernel", 5) for _ in range(40)],
        *[_x("cuda_driver", "cuLaunchKernelEx", 4) for _ in range(20)],
        _x("cuda_runtime", "cudaStreamSynchronize", 3000),
        _x("cuda_runtime", "cudaMemcpyAsync", 10),  # asynchronous: not a sync
        _x("cuda_runtime", "cudaMemcpy", 1000),  # the blocking copy behind .item()
        _x("cpu_op", "aten::item", 1200),
        _x("kernel", "gemm", 9999),  # GPU side: not the host's
    ]
    t = host_table({"traceEvents": events}, steps=2)
    assert t["launches_per_step"] == 30
    assert t["sync_calls_per_step"] == 1 and t["host_blocked_ms_per_step"] == 2.0
    assert t["runtime_calls"]["cudaStreamSynchronize"] == {"calls": 0.5, "ms": 1.5}
    assert list(t["cpu_ops_inclusive"]) == ["aten::item"]
