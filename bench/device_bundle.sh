#!/bin/bash
# On the development machine: build the wheel bundle bench/device_setup.sh unpacks on the lent GPU
# machine (python 3.12, torch 2.11 + cu130 already there; no index reachable from it), split into
# parts that fit one call's carry (64 MiB). dskit's trainer wheels (DeepSpeed, pydantic, hjson,
# transformers, tokenizers, safetensors, torchao for training.fp8) and FlashAttention-4 with exactly the lock of
# dskit/catalog/images.yaml `flash_attn_4` go unpacked into site.tar.xz; peft and accelerate as wheels
# in dsw/. With TT_REF (shared/reference/torchtitan: tt_run.py, base.toml, make_assets.py), torchtitan's
# runner, its assets and its wheels (tt.tar.xz, ttw/) are added for bench/peer_bench.py.
# The bundle refuses to build if FlashAttention-4's CuTe DSL sources are missing: nvidia-cutlass-dsl
# 4.6+ is a metadata wheel whose `cutlass` package comes from -libs-base (the MLIR bindings) and
# -libs-core (cutlass/__init__.py, cutlass/cute/), both only dependencies, which --no-deps skips.
#   bash bench/device_bundle.sh OUTDIR     -> OUTDIR/paa, OUTDIR/pab, ... (each under one call's carry)
set -euo pipefail
out=${1:?usage: device_bundle.sh OUTDIR}
pip=${PIP:-pip}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
P=(--only-binary=:all: --python-version 3.12 --implementation cp --no-deps
   --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
   --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64)
# DeepSpeed ships an sdist only: its wheel is pure Python when no op is prebuilt (needs torch here)
DS_BUILD_OPS=0 "$pip" wheel -q --no-deps --no-build-isolation -w "$W/site-whl" deepspeed==0.19.8
"$pip" download -q "${P[@]}" -d "$W/site-whl" "pydantic==2.*" pydantic-core annotated-types \
  typing-inspection hjson transformers==5.24.0 tokenizers safetensors==0.8.0 \
  flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2 cuda-bindings==13.3.1 cuda-pathfinder \
  torchao==0.18.0
"$pip" download -q "${P[@]}" -d "$W/b/dsw" peft==0.21.2 accelerate==1.15.0
"$pip" install -q "${P[@]}" --target "$W/site" "$W"/site-whl/*.whl
dsl="$W/site/nvidia_cutlass_dsl/dsl_packages/cutlass"
for f in __init__.py cute/__init__.py _mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so; do
  [ -f "$dsl/$f" ] || { echo "FlashAttention-4 would not import: $dsl/$f missing from the wheels" >&2; exit 1; }
done
tar cJf "$W/b/site.tar.xz" -C "$W/site" .
if [ -n "${TT_REF:-}" ]; then  # shared/reference/torchtitan/README.md: its wheels kept apart from dskit's
  "$pip" download -q "${P[@]}" -d "$W/b/ttw" torchtitan==0.2.2 torchdata datasets==4.0.0 dill==0.3.8 \
    multiprocess==0.70.16 tyro docstring-parser typeguard shtab tomli
  mkdir -p "$W/tt/run"
  cp "$TT_REF"/tt_run.py "$TT_REF"/base.toml "$W/tt/run/"
  python3 "$TT_REF"/make_assets.py "$W/tt/run/assets"
  tar cJf "$W/b/tt.tar.xz" -C "$W/tt" .
fi
rm -rf "$out" && mkdir -p "$out"
tar cf "$W/bundle.tar" -C "$W/b" .
split -b 40M "$W/bundle.tar" "$out/p"
ls -la "$out"
