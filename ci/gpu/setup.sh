#!/usr/bin/env bash
# Steps 2 and 3 (GPU machine, repo root): install what travelled in .stage/, unpack the vLLM bundle once all its
# parts have arrived (replacing another bundle unpacked earlier), build exllamav3's extension once per machine.
# Idempotent. Usage: [WAIT_BUILD=1] ci/gpu/setup.sh. See ci/gpu/README.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source ci/gpu/env.sh
mkdir -p /tmp/site /tmp/vllm-parts
# the vLLM bundle's parts (one a run); parts of another staging (another sha256) replace those kept so far
for d in .stage/vllm-*; do
  [ -f "$d/sha256" ] || continue
  if [ "$(cat "$d/sha256")" != "$(cat /tmp/vllm-parts/sha256 2>/dev/null)" ]; then
    rm -f /tmp/vllm-parts/*
  fi
  cp "$d"/part-* "$d"/sha256 "$d"/parts /tmp/vllm-parts/
done
parts=$(cat /tmp/vllm-parts/parts 2>/dev/null || echo 0)
have=$(find /tmp/vllm-parts -name 'part-*' | wc -l)
want=$(cat /tmp/vllm-parts/sha256 2>/dev/null || true)
if [ -n "$want" ] && [ "$(cat /tmp/site/.vllm-bundle 2>/dev/null)" = "$want" ]; then
  : # this bundle is unpacked already
elif [ "$parts" -gt 0 ] && [ "$have" -eq "$parts" ]; then
  cat /tmp/vllm-parts/part-* > /tmp/vllm-slim.tar.xz
  echo "$want  /tmp/vllm-slim.tar.xz" | sha256sum -c -
  # another bundle (another vLLM) may be unpacked: remove what it unpacked (listed when it was), and everything the
  # new one brings (bundles unpacked before that list existed), with any other version's dist-info of the same
  # projects; the console scripts one by one, since bin/ also holds the wheels' scripts
  tar -tJf /tmp/vllm-slim.tar.xz | sed 's|^\./||; s|/$||' | awk -F/ '($1 != "bin" && NF == 1) || ($1 == "bin" && NF == 2)' \
    > /tmp/vllm-slim.entries
  if [ -f /tmp/site/.vllm-bundle-entries ]; then
    (cd /tmp/site && xargs -d '\n' rm -rf -- < .vllm-bundle-entries)
  fi
  (cd /tmp/site && xargs -d '\n' rm -rf -- < /tmp/vllm-slim.entries)
  grep '\.dist-info$' /tmp/vllm-slim.entries | sed 's/-.*//' | while read -r project; do
    rm -rf /tmp/site/"$project"-*.dist-info
  done
  rm -f /tmp/site/.vllm-bundle /tmp/site/.vllm-bundle-entries
  tar -xJf /tmp/vllm-slim.tar.xz -C /tmp/site
  mv /tmp/vllm-slim.entries /tmp/site/.vllm-bundle-entries
  echo "$want" > /tmp/site/.vllm-bundle
  rm -f /tmp/site/.quantpack-wheels  # the wheels go in again over it (the old bundle may have held some of them)
  rm -f /tmp/vllm-slim.tar.xz
  echo "vLLM bundle unpacked: $(python3 -c 'import vllm; print(vllm.__version__)')"
else
  echo "vLLM bundle: $have of $parts parts here so far"
fi
# the wheels, once per set of wheels (runs in parallel must not reinstall under each other)
if compgen -G ".stage/whl/*.whl" >/dev/null; then
  stamp=$(cat .stage/whl/*.whl | sha256sum | cut -d' ' -f1)
  if [ "$(cat /tmp/site/.quantpack-wheels 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .stage/whl/*.whl
    echo "$stamp" > /tmp/site/.quantpack-wheels
    echo "installed: $(ls .stage/whl | tr '\n' ' ')"
  fi
fi
if compgen -G ".stage/nox/*.whl" >/dev/null && ! [ -d /tmp/nox-site/nox ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/nox-site .stage/nox/*.whl
  echo "nox installed into /tmp/nox-site"
fi
# a prebuilt extension (staged from an earlier build on an identical machine, see stage.sh) saves the build
if [ -f .stage/ext/exllamav3_ext.so.xz ] && ! [ -f /tmp/ext-built ]; then
  mkdir -p /tmp/ext-prebuilt
  xz -dc .stage/ext/exllamav3_ext.so.xz > /tmp/ext-prebuilt/exllamav3_ext.so
  if python3 -c "from quantpack_exl3.backends.exllamav3.extension import load_extension; load_extension()"; then
    touch /tmp/ext-built
    echo "exllamav3 extension: prebuilt one loaded"
    # a JIT build started by an earlier run (before the prebuilt one arrived) would only compete for the cores
    if [ -f /tmp/ext-build.pid ] && kill -0 "$(cat /tmp/ext-build.pid)" 2>/dev/null; then
      kill -- -"$(cat /tmp/ext-build.pid)" 2>/dev/null || kill "$(cat /tmp/ext-build.pid)" 2>/dev/null || true
      echo "stopped the JIT build started earlier"
    fi
  else
    rm -f /tmp/ext-prebuilt/exllamav3_ext.so
    echo "exllamav3 extension: the prebuilt one does not load here; building"
  fi
fi
# trellis_mma's library staged by stage.sh: into this machine's build cache, used when it was built by the nvcc this
# machine has (the library's cache key), else built here on first use
if compgen -G ".stage/ext/trellis_mma-*.so.xz" >/dev/null; then
  python3 -c "
import ctypes, lzma, pathlib, sys
from quantpack_exl3.backends.trellis_mma.library import LibraryError, cache_dir, library_path
for staged in map(pathlib.Path, sys.argv[1:]):
    name = staged.name[: -len('.xz')]
    target = cache_dir() / name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_suffix('.part')
        part.write_bytes(lzma.decompress(staged.read_bytes()))
        part.chmod(0o755)
        try:  # built on another machine: it must load here (its C library), else the first use builds one
            ctypes.CDLL(str(part))
        except OSError as e:
            part.unlink()
            print('trellis_mma:', name, 'does not load here, built on first use instead:', e)
            continue
        part.replace(target)
    try:
        same = library_path(int(name.split('-sm')[1].split('-')[0])).name == name
    except LibraryError as e:
        same = False
        print(e)
    print('trellis_mma:', name, 'staged and used' if same else 'staged, but built by another nvcc: built here on first use')
" .stage/ext/trellis_mma-*.so.xz
fi
# the extension: JIT-built on first import, cached in $TORCH_EXTENSIONS_DIR; built in the background (setsid) so it
# survives this command, tracked through its pid file
building() { [ -f /tmp/ext-build.pid ] && kill -0 "$(cat /tmp/ext-build.pid)" 2>/dev/null; }
if ! [ -f /tmp/ext-built ]; then
  if ! building; then
    setsid bash -c 'source ci/gpu/env.sh; python3 -c "
from quantpack_exl3.backends.exllamav3.extension import load_extension; load_extension(); print(\"built\")
" > /tmp/ext-build.log 2>&1 && touch /tmp/ext-built' > /dev/null 2>&1 < /dev/null &
    echo $! > /tmp/ext-build.pid
    echo "exllamav3 extension build started (log: /tmp/ext-build.log)"
  fi
  if [ "${WAIT_BUILD:-0}" = 1 ]; then
    while ! [ -f /tmp/ext-built ]; do
      if ! building && ! [ -f /tmp/ext-built ]; then
        echo "extension build failed:"; tail -30 /tmp/ext-build.log; exit 1
      fi
      sleep 5
    done
    echo "exllamav3 extension ready"
  fi
fi
