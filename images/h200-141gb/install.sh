#!/bin/bash
# Rendered by dskit 0.1.0: the Python install of the h200-141gb image (cu130 lock).
# The Dockerfile runs this file as is; CI runs the cpu one in a fresh venv (PYTHON=..., and
# DSKIT_TORCH_INDEX= because CI reaches PyPI only).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python}
torch_index=${DSKIT_TORCH_INDEX-''}

"$PY" -m pip install --upgrade pip setuptools wheel
# torch first and alone: everything after builds against exactly this ABI.
"$PY" -m pip install ${torch_index:+--index-url "$torch_index"} "torch==2.11.0"
"$PY" -m pip install -r "$here/requirements.lock"

# DeepSpeed with its ops compiled now, not JIT-compiled by every worker at start-up...
export DS_BUILD_OPS=0 DS_BUILD_CPU_ADAM=1
# ...for a stated ISA, not the build host's: DeepSpeed's op builder compiles CPU code with -march=native
# and picks its AVX-512 kernels when the build host has them (op_builder/builder.py, cpu_arch() and
# simd_width(); there is no switch), and such an image dies of "illegal instruction" on older nodes.
# The compilers it calls go through a wrapper that puts the baseline in place of both.
isa=${DSKIT_CPU_ISA:-x86-64-v3}
case "$isa" in
  x86-64 | x86-64-v2 | x86-64-v3 | x86-64-v4 | native) ;;
  *) echo "install.sh: error: DSKIT_CPU_ISA: unknown value; one of: x86-64, x86-64-v2, x86-64-v3, x86-64-v4, native" >&2; exit 2 ;;
esac
if [ "$(uname -m)" = x86_64 ] && [ "$isa" != native ]; then
  case "$isa" in
    x86-64-v4) simd=-D__AVX512__ ;;
    x86-64-v3) simd=-D__AVX256__ ;;
    *) simd=-D__SCALAR__ ;;
  esac
  wrap=$(mktemp -d)
  for cc in gcc g++; do
    real=$(command -v "$cc")
    cat >"$wrap/$cc" <<EOF
#!/bin/bash
args=()
for a in "\$@"; do
  case "\$a" in
    -march=native) args+=(-march=$isa) ;;
    -D__AVX512__ | -D__AVX256__ | -D__SCALAR__) args+=($simd) ;;
    *) args+=("\$a") ;;
  esac
done
exec $real "\${args[@]}"
EOF
    chmod +x "$wrap/$cc"
  done
  export CC="$wrap/gcc" CXX="$wrap/g++"
fi
# FusedAdam: the engine's Adam on GPUs, prebuilt so a runtime image without nvcc never JIT-compiles it
export DS_BUILD_FUSED_ADAM=1
# --no-cache-dir: a cached DeepSpeed wheel built without these flags would be reused silently
"$PY" -m pip install --no-cache-dir --no-build-isolation "deepspeed==0.19.8"

# FlashAttention-4 (Hopper): wheels only, nothing compiled here; its kernels compile at first call
# (seconds) for the shapes the run uses. Measured faster than cuDNN SDPA and FlashAttention-2 for MLA
# (docs/planner.md "Attention on each GPU"), so the image carries no other attention build.
"$PY" -m pip install --no-cache-dir 'flash-attn-4[cu13]==4.0.0b36' 'nvidia-cutlass-dsl[cu13]==4.8.1' nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2 cuda-bindings==13.3.1 protobuf==7.36.2
