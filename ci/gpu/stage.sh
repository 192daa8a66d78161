#!/usr/bin/env bash
# Step 1 (here): stage what the GPU machine needs under .stage/ (git-ignored). See ci/gpu/README.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
stage=.stage
bundle=${VLLM_BUNDLE:-$root/../shared/gpu/vllm-slim-0.25.1.tar.xz}
if [ ! -f "$bundle" ]; then
  echo "stage.sh: no vLLM bundle at $bundle; set VLLM_BUNDLE=/path/to/vllm-slim-0.25.1.tar.xz (see ci/gpu/README.md)" >&2
  exit 2
fi
rm -rf "$stage/whl" "$stage/nox"
mkdir -p "$stage/whl" "$stage/nox"
uv=(uv); command -v uv >/dev/null 2>&1 || uv=(python3 -m uv)
for pkg in packages/quantpack-core packages/quantpack-exl3 packages/quantpack-escha-rocm packages/quantpack-families; do
  "${uv[@]}" build --quiet --wheel --out-dir "$stage/whl" "$pkg"
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$stage/whl" exllamav3==1.6.5 marisa-trie
# the slim vLLM bundle lacks compressed-tensors (and its loguru), which vLLM imports as soon as any quantization
# method is resolved
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$stage/whl" compressed-tensors==0.17.0 loguru
# nox and its dependencies (travels with the second part; installed apart from /tmp/site so that its packaging /
# filelock never shadow the machine's own)
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$stage/nox" nox
# optional: a prebuilt exllamav3_ext.so (xz) from an earlier build on an identical machine (same torch, CUDA and
# GPU arch: torch.utils.cpp_extension's output under $TORCH_EXTENSIONS_DIR/exllamav3_ext/); never committed
rm -rf "$stage/ext"
if [ -n "${EXL3_EXT_SO_XZ:-}" ]; then
  mkdir -p "$stage/ext"
  cp "$EXL3_EXT_SO_XZ" "$stage/ext/exllamav3_ext.so.xz"
fi
# the bundle in four parts (.stage/vllm-a .. -d, about 14 MB each), so that each run stays under the 64 MiB that
# travels with the checkout (about 48 MB of it tracked files)
rm -rf "$stage"/vllm-? "$stage"/part-*
split -n 4 -d "$bundle" "$stage/part-"
for i in 0 1 2 3; do
  d="$stage/vllm-$(echo abcd | cut -c$((i + 1)))"
  mkdir -p "$d"
  mv "$stage/part-0$i" "$d/"
  sha256sum "$bundle" | cut -d' ' -f1 > "$d/sha256"
  echo 4 > "$d/parts"
done
du -sh "$stage"/*
