#!/usr/bin/env bash
# Here: stage what the GPU machine needs under .stage/ (git-ignored). See ci/gpu/README.md.
# Usage: VLLM_BUNDLE=path/to/vllm-slim-VERSION.tar.xz [EXL3_EXT_SO_XZ=path] [UPLOAD_LIMIT=64MiB] [VLLM_PARTS=N] \
#          ci/gpu/stage.sh
#   VLLM_BUNDLE     the slim vLLM bundle (ci/gpu/bundle.sh builds one)
#   EXL3_EXT_SO_XZ  a prebuilt exllamav3_ext.so (xz) from an identical machine; unset: the GPU machine builds it
#   UPLOAD_LIMIT    bytes one upload to the GPU machine may carry with the checkout: the bundle is split into parts
#                   that each fit beside it (ci/transfer/parts.py); unset: one part
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
stage=.stage
bundle=${VLLM_BUNDLE:-}
if [ -z "$bundle" ] || [ ! -f "$bundle" ]; then
  echo "stage.sh: VLLM_BUNDLE=${bundle:-(unset)} names no vLLM bundle: set VLLM_BUNDLE=/path/to/vllm-slim-VERSION.tar.xz," \
    "e.g. one built by ci/gpu/bundle.sh (see ci/gpu/README.md)" >&2
  exit 2
fi
# the bundle's release, read before anything is built (./vllm-<release>[+local].dist-info/ among its entries); each
# release's parts go in their own folders (below), so a second release staged beside the first travels while the
# first one's tests run, setup.sh keeping the unpacked one until VLLM_RELEASE names it
release=$(tar -tJf "$bundle" | sed -nE 's|^(\./)?vllm-([0-9][0-9.]*[0-9])(\+[^/]*)?\.dist-info/.*|\2|p' | sort -u)
if [ "$(wc -w <<<"$release")" != 1 ]; then
  echo "stage.sh: $bundle holds no single vllm-<release>.dist-info (found: ${release:-none}): not a vLLM bundle" >&2
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
# vLLM imports compressed-tensors (and its loguru) as soon as any quantization method is resolved: bundles built by
# ci/gpu/bundle.sh carry the version their release pins, a bundle without them takes these; staged always, setup.sh
# leaves out a wheel of a project the unpacked bundle carries (0.22.1's 0.15.0.1 stays), so the staged wheels serve
# every release staged
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$stage/whl" compressed-tensors==0.17.0 loguru
# nox and its dependencies (travels with the second part; installed apart from /tmp/site so that its packaging /
# filelock never shadow the machine's own)
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$stage/nox" nox
# optional: a prebuilt exllamav3_ext.so (xz) from an earlier build on an identical machine (same torch, CUDA and
# GPU arch: torch.utils.cpp_extension's output under $TORCH_EXTENSIONS_DIR/exllamav3_ext/); never committed. Unset:
# none staged, and the GPU machine builds it (about 4.5 minutes on 16 cores)
if [ -n "${EXL3_EXT_SO_XZ:-}" ] && [ ! -f "$EXL3_EXT_SO_XZ" ]; then
  echo "stage.sh: EXL3_EXT_SO_XZ=$EXL3_EXT_SO_XZ: no such file" >&2
  exit 2
fi
rm -rf "$stage/ext"
if [ -z "${EXL3_EXT_SO_XZ:-}" ]; then
  echo "stage.sh: no prebuilt exllamav3_ext staged: the GPU machine builds it on first use (about 4.5 minutes)" >&2
else
  mkdir -p "$stage/ext"
  cp "$EXL3_EXT_SO_XZ" "$stage/ext/exllamav3_ext.so.xz"
fi
# trellis_mma's library for sm_90, built here when this machine has nvcc (kept in .stage-cache/ across stagings, keyed
# as the library keys its build cache): setup.sh puts it in the GPU machine's build cache, where it is used when that
# machine's `nvcc --version` says what this one's does, saving its first use the build (about 2 minutes of device
# time); otherwise the first use builds there as before. TRELLIS_MMA_PREBUILD=0 skips it
if [ "${TRELLIS_MMA_PREBUILD:-1}" != 0 ] && command -v nvcc >/dev/null 2>&1; then
  mkdir -p "$stage/ext"
  lib=$(QUANTPACK_CACHE_DIR="$root/.stage-cache" python3 -c "
import sys, types
package = types.ModuleType('trellis_mma')  # its library module alone: standard library only, no torch needed here
package.__path__ = ['packages/quantpack-core/src/quantpack_core/trellis_mma']
sys.modules['trellis_mma'] = package
from trellis_mma import library
print(library.build(90))")
  xz -T0 -c "$lib" > "$stage/ext/$(basename "$lib").xz"
fi
# the bundle in parts (.stage/vllm-<release>-a, -b, ...), each small enough to travel beside the checkout (its tracked
# and untracked-not-ignored files) within UPLOAD_LIMIT; VLLM_PARTS=N forces N
# (a tracked file removed from the work tree does not travel and counts nothing: stat's failure on it is no error)
checkout=$(git ls-files -z --cached --others --exclude-standard | { xargs -0 stat -c %s 2>/dev/null || true; } |
  awk '{s += $1} END {print s + 0}')
rm -rf "$stage"/vllm-? "$stage"/part-*
python3 ci/transfer/parts.py split "$bundle" --out "$stage" --label "vllm-$release" --beside "$checkout" \
  ${UPLOAD_LIMIT:+--limit "$UPLOAD_LIMIT"} ${VLLM_PARTS:+--parts "$VLLM_PARTS"}
du -sh "$stage"/*
# .stage/ext travels with the checkout and the source snapshot (.stage/head, about 1 MB) in one upload
ext=$(du -sb "$stage/ext" 2>/dev/null | cut -f1)
if [ -n "${UPLOAD_LIMIT:-}" ] && [ -n "$ext" ]; then
  limit=$(python3 -c "import sys; sys.path.insert(0, 'ci/transfer'); import parts; print(parts.size(sys.argv[1]))" "$UPLOAD_LIMIT")
  if [ $((checkout + ext + 1024 * 1024)) -gt "$limit" ]; then
    echo "stage.sh: .stage/ext ($ext bytes) with the checkout ($checkout) and a 1 MB snapshot exceeds UPLOAD_LIMIT:" \
      "carry .stage/ext/*.so.xz in two uploads, or stage again with TRELLIS_MMA_PREBUILD=0" >&2
  fi
fi
