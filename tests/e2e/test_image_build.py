"""The CPU image, built for real with `dskit build image` and used: `dskit doctor` and the 2-rank CPU demo
(render -> train -> export) inside it, DeepSpeed's compiled ops within x86-64-v3, the export loaded here.

Needs root, podman and the local base image that `.ci/image-setup.sh` makes (no registry is reachable:
the base is a debootstrapped Debian with the host's CA certificates; CPU torch comes from the host's
wheel directory, mounted read-only into the build). Skipped where they are missing, except in CI
(CI=true), where a missing engine is a failure. Marker `image`: `make test-fast` leaves it out.
Most of its time is compiling DeepSpeed's CPU ops (its duration: docs/development.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import dskit
from tests.support.isa import check_ops_within_v3

pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.network]

BASE = os.environ.get("DSKIT_CI_BASE", "localhost/dskit-ci-base:bookworm")
TAG = "localhost/dskit:cpu-ci"
WHEELS = os.environ.get("DSKIT_WHEELS", "/opt/wheels")  # the host's CPU torch wheel, if it has one


def _missing() -> str | None:
    if shutil.which("podman") is None:
        return "podman is not installed (run .ci/image-setup.sh)"
    if os.geteuid() != 0:
        return "needs root (rootful podman, chroot isolation)"
    if subprocess.run(["podman", "image", "exists", BASE]).returncode != 0:
        return f"no base image {BASE} (run .ci/image-setup.sh)"
    return None


@pytest.fixture(scope="module")
def built():
    why = _missing()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI builds the CPU image: {why}")
        pytest.skip(why)
    args = [
        "build",
        "image",
        "--gpu",
        "cpu",
        "--tag",
        TAG,
        "--engine",
        "podman",
        f"--build-arg=BUILDER_IMAGE={BASE}",
        f"--build-arg=RUNTIME_IMAGE={BASE}",
        # torch from the base's pip configuration (PyPI + the mounted wheel directory), not PyTorch's index
        "--build-arg=DSKIT_TORCH_INDEX=",
        "--engine-arg=--isolation=chroot",
        "--engine-arg=--network=host",  # pip and apt reach their indexes through the host's network
    ]
    if Path(WHEELS).is_dir():
        args.append(f"--engine-arg=--volume={WHEELS}:/opt/wheels:ro")
    r = dskit(*args, timeout=3600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-6000:]
    m = re.search(r"^built (\S+) with podman in \S+ \((\d+) s\): ([\d.]+) GiB$", r.stdout, re.M)
    assert m and m.group(1) == TAG, r.stdout
    print(f"image build: {m.group(2)} s, {m.group(3)} GiB")  # shown with -s / in CI's log (-rA)
    return TAG


def run_in(image: str, script: str, *, mounts: dict[Path, str] | None = None, timeout: float = 900):
    """bash -c SCRIPT in a fresh container: no network, 2 GiB of /dev/shm (the doctor checks it)."""
    cmd = ["podman", "run", "--rm", "--network=none", "--shm-size=2g"]
    for host, inside in (mounts or {}).items():
        cmd.append(f"--volume={host}:{inside}")
    cmd += [image, "bash", "-c", script]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_doctor_passes_in_the_image(built):
    r = run_in(built, "dskit doctor --json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    for op in ("cpu_adam", "deepspeed_shm_comm"):  # in the DeepSpeed install, not torch's JIT cache
        assert (checks[f"deepspeed op {op}"]["status"], checks[f"deepspeed op {op}"]["detail"]) == (
            "PASS",
            "prebuilt",
        )
    assert "deepspeed op fused_adam" not in checks  # the CPU accelerator trains with torch's AdamW
    assert not [c for c in checks.values() if c["status"] == "FAIL"]


def test_ops_in_the_image_are_within_the_baseline_isa(built, tmp_path):
    """The image was built on this host (AVX-512 here): its ops must still be x86-64-v3 code."""
    out = tmp_path / "site"
    out.mkdir()
    r = run_in(
        built,
        "cd /opt/venv/lib/python3*/site-packages && find deepspeed -name '*.so' -exec cp --parents {} /out \\;",
        mounts={out: "/out"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    names = check_ops_within_v3(out)
    assert any(n.startswith("deepspeed_shm_comm") for n in names), names


def test_demo_trains_and_exports_in_the_image(built, tmp_path):
    """`make demo`'s steps, shorter, in the image: render a Slurm run dir for 2 CPU ranks, train it with
    `dskit train --local`, export it (the export checks its logits against the trainer's)."""
    work = tmp_path / "work"
    work.mkdir()
    script = """set -euo pipefail
cd /work
dskit render slurm -o run --job-name demo --gpu cpu --gpus-per-node 2 --model tiny-v2 --runtime none \\
  --set runtime.python=/opt/venv/bin/python --set storage.root=/work/storage --set training.seq_len=128 \\
  --set training.global_batch=8 --set training.steps=30 --set training.lr=3e-3 --set training.log_every=5 \\
  --set checkpoint.every=30
dskit train --local run
dskit export run -o hf
"""
    r = run_in(built, script, mounts={work: "/work"}, timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    metrics = [
        json.loads(line)
        for line in next((work / "storage").rglob("metrics.jsonl")).read_text().splitlines()
        if line.strip()
    ]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert losses and losses[-1] < losses[0], losses
    # the export, read back here by transformers (outside the image)
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = work / "hf"
    assert (hf / "config.json").is_file() and list(hf.glob("*.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf))
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape[:2] == (1, 4) and torch.isfinite(logits).all()
