#!/usr/bin/env bash
# The image's ahead-of-time ops, as far as a GPU machine without a package index allows: the DeepSpeed part of a
# rendered image's install.sh (ops compiled ahead of time, for the image's TORCH_CUDA_ARCH_LIST), run
# as is in a fresh venv, then the same few training steps with those ops and with the JIT path.
#
#   bash bench/aot_ops_bench.sh images/h200-141gb WHEEL_DIR SDIST_DIR OUT.json
#
# No index is reached: WHEEL_DIR holds the wheels the machine lacks (a deepspeed wheel there is not
# used), SDIST_DIR DeepSpeed's sdist, the one pip finds when install.sh asks for deepspeed. torch and the rest come from the machine's own environment (--system-site-packages):
# the lock's other pins (ray, kubernetes: 100+ MB) cannot be carried to the device machine, and the
# FlashAttention builds (hours of nvcc, a git clone) are not part of this measurement.
set -euo pipefail
image_dir=$1 wheels=$(cd "$2" && pwd) sdists=$(cd "$3" && pwd) out=$4
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
arch=$(sed -n 's/^ENV TORCH_CUDA_ARCH_LIST="\([^"]*\)".*/\1/p' "$image_dir/Dockerfile")
# the block of install.sh from DeepSpeed's comment to its pip install, byte for byte
sed -n '/^# DeepSpeed with its ops compiled now/,/"deepspeed==[^"]*"$/p' "$image_dir/install.sh" >"$work/ds.sh"
grep -q 'deepspeed==' "$work/ds.sh"

python3 -m venv "$work/venv"
py=$work/venv/bin/python
# the machine's python3 may itself be a venv (torch in /opt/...): --system-site-packages would skip it
python3 -c 'import site; print("\n".join(site.getsitepackages()))' >"$("$py" -c 'import site; print(site.getsitepackages()[0])')/machine.pth"
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$sdists" PIP_DISABLE_PIP_VERSION_CHECK=1
find "$wheels" -maxdepth 1 -name '*.whl' ! -name 'deepspeed-*' -exec "$py" -m pip install -q --no-deps {} +
t0=$(date +%s.%N)
# shellcheck disable=SC1091  # written above
(export PY=$py TORCH_CUDA_ARCH_LIST=$arch && source "$work/ds.sh") >"$work/build.log" 2>&1 ||
  { tail -50 "$work/build.log"; exit 1; }
build_s=$(python3 -c "import time; print(round(time.time() - $t0, 1))")

# the same 10 steps: ops from the image build (fresh extension dir: nothing to reuse), then the JIT path
steps() { # NAME PYTHON EXTRA_PYTHONPATH
  local rd=$work/$1
  PYTHONPATH=$3$repo "$2" -m dskit render slurm --force -o "$rd" --gpu h200-141gb --gpus-per-node 1 \
    --model deepseek-v2-lite --runtime none --set model.num_layers=4 --set training.seq_len=4096 \
    --set training.global_batch=16 --set training.steps=10 --set training.log_every=1 \
    --set checkpoint.final=false --set "storage.root=$work/storage-$1" >/dev/null
  local t
  t=$(date +%s.%N)
  TORCH_EXTENSIONS_DIR=$work/ext-$1 PYTHONPATH=$3$repo "$2" -m dskit train --local "$rd" >"$work/$1.log" 2>&1
  python3 -c "import time; print(round(time.time() - $t, 1))"
}
aot_wall=$(steps aot "$py" "")
PYTHONPATH=$repo "$py" -m dskit doctor --json >"$work/doctor.json" || true
jit_wall=$(steps jit python3 "${JIT_SITE:+$JIT_SITE:}")

WORK=$work BUILD_S=$build_s AOT_WALL=$aot_wall JIT_WALL=$jit_wall ARCH=$arch IMAGE=$image_dir OUT=$out "$py" - <<'EOF'
import json, os, re, subprocess
from pathlib import Path
w = Path(os.environ["WORK"])
def ops(py):
    code = "from deepspeed.git_version_info import installed_ops as o; import json; print(json.dumps({k: v for k, v in o.items() if v}))"
    r = subprocess.run([py, "-c", code], capture_output=True, text=True)
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else r.stderr[-500:]
def summary(name):
    log = (w / f"{name}.log").read_text()
    recs = [json.loads(x) for p in (w / f"storage-{name}").rglob("metrics.jsonl") for x in p.read_text().splitlines() if x.strip()]
    recs = [r for r in recs if "step_time_s" in r]
    return {
        "wall_s": float(os.environ[f"{name.upper()}_WALL"]),
        "steps": len(recs),
        "step1_s": recs[0]["step_time_s"] if recs else None,
        "jit_compiled": sorted(set(re.findall(r"Building extension module (\w+)", log))),
        "loaded_prebuilt_or_jit": sorted(set(re.findall(r"Loading extension module (\w+)", log))),
        "loss_last": recs[-1]["loss"] if recs else None,
        "tail": log[-1500:] if not recs else None,
    }
doctor = json.loads((w / "doctor.json").read_text() or "[]")
res = {
    "image": os.environ["IMAGE"],
    "torch_cuda_arch_list": os.environ["ARCH"],
    "deepspeed_block_build_s": float(os.environ["BUILD_S"]),
    "installed_ops_aot": ops(str(w / "venv/bin/python")),
    "doctor_aot": [c for c in doctor if "deepspeed" in c["name"]],
    "train_10_steps": {"aot": summary("aot"), "jit": summary("jit")},
    "build_log_tail": (w / "build.log").read_text()[-1500:],
}
Path(os.environ["OUT"]).write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps({k: v for k, v in res.items() if k != "build_log_tail"}, indent=1))
EOF
