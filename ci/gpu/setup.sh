#!/usr/bin/env bash
# Steps 2 and 3 (GPU machine, repo root): install what travelled in .stage/, unpack the vLLM bundle once both
# parts have arrived, build exllamav3's extension once per machine. Idempotent. See ci/gpu/README.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source ci/gpu/env.sh
mkdir -p /tmp/site /tmp/vllm-parts
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
for d in .stage/vllm-?; do
  [ -d "$d" ] && cp "$d"/part-* "$d"/sha256 "$d"/parts /tmp/vllm-parts/ 2>/dev/null || true
done
parts=$(cat /tmp/vllm-parts/parts 2>/dev/null || echo 0)
have=$(find /tmp/vllm-parts -name 'part-*' | wc -l)
if [ ! -f /tmp/site/vllm/__init__.py ] && [ "$parts" -gt 0 ] && [ "$have" -eq "$parts" ]; then
  cat /tmp/vllm-parts/part-* > /tmp/vllm-slim.tar.xz
  echo "$(cat /tmp/vllm-parts/sha256)  /tmp/vllm-slim.tar.xz" | sha256sum -c -
  tar -xJf /tmp/vllm-slim.tar.xz -C /tmp/site
  rm -f /tmp/vllm-slim.tar.xz
  echo "vLLM bundle unpacked: $(python3 -c 'import vllm; print(vllm.__version__)')"
elif [ ! -f /tmp/site/vllm/__init__.py ]; then
  echo "vLLM bundle: $have of $parts parts here so far"
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
