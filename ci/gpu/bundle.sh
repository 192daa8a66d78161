#!/usr/bin/env bash
# Builds the GPU tier's slim vLLM bundle of one release from PyPI wheels: vLLM and the packages of its dependency
# tree that the GPU machine lacks (ci/gpu/bundle-deps.txt), installed for CPython 3.12 manylinux x86_64, with the
# FlashAttention, FlashMLA, DeepGEMM, QuTLASS and Blackwell FMHA binaries, the vllm-rs binary and the API docs'
# static files removed, vLLM's device code cut to sm_90, debug info stripped, headers and sources of the native
# dependencies dropped, then packed reproducibly (names sorted, one mtime, owner 0:0, single-threaded xz -9).
#
# Usage: ci/gpu/bundle.sh VERSION [--relock]
#   VERSION   a vLLM release that pins torch==2.11.0 (0.20.0 - 0.26.0; 0.21.0 has no x86_64 wheel)
#   --relock  resolve the dependency tree again and rewrite ci/gpu/locks/vllm-VERSION.txt (otherwise the lock is
#             read when it exists, and written when it does not)
# Writes .stage-bundles/vllm-slim-VERSION.tar.xz and its .sha256, then verifies it (ci/gpu/bundle_tools.py verify)
# and compares the third-party imports on the tier's path with those of a bundle that ran the tier
# (ci/gpu/import_reach.py; PROVEN_BUNDLE=path, skipped, and said so, when unset): a package the new release imports
# there that neither bundle nor machine has fails the script, before any device time.
# Stage it with `VLLM_BUNDLE=.stage-bundles/vllm-slim-VERSION.tar.xz ci/gpu/stage.sh` (see ci/gpu/README.md).
# Environment: BUNDLE_OUT (output folder, default .stage-bundles), SOURCE_DATE_EPOCH (the archive's mtime, default
# 2026-01-01), TARGET_PYTHON (bin/vllm's interpreter, default the GPU machine's /opt/torch/.venv/bin/python3),
# PYTHON (whose pip resolves, downloads and installs; default python3.12 when there is one, else python3),
# KEEP_WORK=1 (keep the unpacked tree under BUNDLE_OUT/work-VERSION), BUNDLE_CONSTRAINTS (pins for resolving,
# default ci/gpu/bundle-constraints.txt: the versions the tier ran with, less those the release's own requirements
# exclude; an empty value resolves to the newest). Needs pip, readelf, strip, GNU tar and xz, and about 1.5 GB of scratch space.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
version=${1:?usage: ci/gpu/bundle.sh VERSION [--relock]}
relock=${2:-}
out=${BUNDLE_OUT:-$root/.stage-bundles}
lock=$here/locks/vllm-$version.txt
epoch=${SOURCE_DATE_EPOCH:-1767225600}
target_python=${TARGET_PYTHON:-/opt/torch/.venv/bin/python3}
work=$out/work-$version
bundle=$out/vllm-slim-$version.tar.xz
mkdir -p "$out" "$here/locks"
rm -rf "$work"
mkdir -p "$work/wheels" "$work/site"
trap '[ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$work"' EXIT

# pip of a Python 3.12 when there is one (markers are then evaluated as on the GPU machine), else python3's
py=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  py=python3.12
fi
target=(--only-binary=:all: --python-version 3.12 --implementation cp)
for glibc in $(seq 39 -1 17); do target+=(--platform "manylinux_2_${glibc}_x86_64"); done
target+=(--platform manylinux2014_x86_64)
pip=("$py" -m pip --disable-pip-version-check --no-input)

# 1. the lock: vLLM's whole tree resolved by pip (metadata only), the carried part pinned with hashes
if [ ! -f "$lock" ] || [ "$relock" = --relock ]; then
  echo "== resolving vllm==$version"
  pins=${BUNDLE_CONSTRAINTS-$here/bundle-constraints.txt}
  : > "$work/constraints.txt"
  if [ -n "$pins" ]; then
    # the pins that this release's own requirements allow
    "${pip[@]}" install --quiet --dry-run --ignore-installed --no-deps "${target[@]}" --target "$work/resolve" \
      --report "$work/vllm.json" "vllm==$version"
    python3 "$here/bundle_tools.py" constraints "$work/vllm.json" "$pins" "$work/constraints.txt"
  fi
  "${pip[@]}" install --quiet --dry-run --ignore-installed "${target[@]}" --target "$work/resolve" \
    --constraint "$work/constraints.txt" --report "$work/report.json" "vllm==$version"
  python3 "$here/bundle_tools.py" lock "$work/report.json" "$here/bundle-deps.txt" "$version" "$lock"
fi

# 2. the wheels, checked against the lock's hashes, installed without dependencies (the lock is the whole set)
echo "== downloading"
"${pip[@]}" download --quiet --no-deps --require-hashes "${target[@]}" -d "$work/wheels" -r "$lock"
echo "== installing into $work/site"
"${pip[@]}" install --quiet --no-deps --no-index --find-links "$work/wheels" --require-hashes --no-compile \
  "${target[@]}" --target "$work/site" -r "$lock"
rm -rf "$work/wheels"

# 3. pruning
cd "$work/site"
drop() {
  local path
  for path in "$@"; do
    if [ -e "$path" ] || [ -L "$path" ]; then
      echo "removed $path ($(du -sh "$path" | cut -f1))"
      rm -rf "$path"
    fi
  done
}
# vLLM's optional binaries the tier does not use (attention runs on TRITON_ATTN; the rest serves other GPUs or
# features); the same paths are checked absent by bundle_tools.py verify
drop vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so \
  vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 \
  vllm/_flashmla_C.abi3.so vllm/_flashmla_extension_C.abi3.so vllm/_qutlass_C.abi3.so \
  vllm/vllm-rs vllm/entrypoints/serve/instrumentator/static
python3 "$here/bundle_tools.py" patch-flash-attn .
# build-time parts of the native dependencies: static libraries, headers, sources, CMake files
drop xgrammar/lib xgrammar/include \
  tvm_ffi/3rdparty tvm_ffi/include tvm_ffi/src tvm_ffi/cython tvm_ffi/share tvm_ffi/CMakeLists.txt
# device code: sm_90 only, in every vLLM library that has any
find vllm -name '*.so' -type f -print0 | sort -z | while IFS= read -r -d '' so; do
  if grep -q '\.nv_fatbin' <<<"$(readelf -S --wide "$so" 2>/dev/null)"; then
    python3 "$here/prune_fatbin.py" "$so"
  fi
done
# debug info, from the libraries that carry it
find . -name '*.so*' -type f -print0 | sort -z | while IFS= read -r -d '' so; do
  if grep -q ' \.debug_info ' <<<"$(readelf -S --wide "$so" 2>/dev/null)"; then
    before=$(stat -c %s "$so")
    strip --strip-debug "$so"
    echo "stripped $so: $before -> $(stat -c %s "$so") bytes"
  fi
done
# console scripts: vllm only, run by the GPU machine's interpreter
if [ -d bin ]; then
  find bin -mindepth 1 ! -name vllm -delete
  [ -f bin/vllm ] && sed -i "1s|^#!.*|#!$target_python|" bin/vllm
fi
find . -name __pycache__ -type d -prune -exec rm -rf {} +
find . -name '*.pyc' -delete
# modes independent of the umask: folders and executables 755, other files 644
find . -type d -exec chmod 755 {} +
find . -type f -perm /111 -exec chmod 755 {} +
find . -type f ! -perm /111 -exec chmod 644 {} +
echo "unpacked: $(du -sh . | cut -f1)"

# 4. the archive
echo "== packing $bundle"
tar --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner --format=gnu -cf - . |
  xz -9 -T1 -c > "$bundle.partial"
mv "$bundle.partial" "$bundle"
cd "$out"
sha256sum "$(basename "$bundle")" > "$bundle.sha256"
cat "$bundle.sha256"

# 5. verification
python3 "$here/bundle_tools.py" verify "$bundle" "$version" "$lock"

# 6. the imports on the tier's path against a bundle that ran it (a package left out would stop every engine)
proven=${PROVEN_BUNDLE:-}
if [ -n "$proven" ] && ! [ -f "$proven" ]; then
  echo "bundle.sh: PROVEN_BUNDLE=$proven: no such file" >&2
  exit 2
fi
if [ -n "$proven" ]; then
  # the new bundle's tree is still unpacked where it was packed from; only the proven one is unpacked here
  proven_site=$(mktemp -d)
  trap '[ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$work"; rm -rf "$proven_site"' EXIT
  tar -xJf "$proven" -C "$proven_site"
  if ! python3 "$here/import_reach.py" "$work/site" "$proven_site"; then
    echo "bundle.sh: classify each package above under [bundle] in ci/gpu/bundle-deps.txt (then --relock), or say why" \
      "the tier never reaches it" >&2
    exit 1
  fi
else
  echo "import check skipped: PROVEN_BUNDLE names no bundle that ran the tier (PROVEN_BUNDLE=path/to/vllm-slim-X.tar.xz)"
fi
