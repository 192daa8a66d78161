#!/usr/bin/env bash
# Steps 2 and 3 (GPU machine, repo root): install what travelled in .stage/, unpack a vLLM bundle once all its
# parts have arrived (the first one complete; another release's only when VLLM_RELEASE names it, replacing the one
# unpacked), build exllamav3's extension once per machine. Idempotent.
# Usage: [WAIT_BUILD=1] [VLLM_RELEASE=0.26.0] ci/gpu/setup.sh. See ci/gpu/README.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
source ci/gpu/env.sh
mkdir -p /tmp/site /tmp/vllm-parts
# the vLLM bundles' parts (one an upload, .stage/vllm-<release>-<letter>/ from stage.sh), kept per bundle (sha256) in
# /tmp/vllm-parts/<sha256>/ (ci/transfer/parts.py), so that a second release's parts can travel while the first
# release's tests run
python3 ci/transfer/parts.py gather .stage/vllm-* --store /tmp/vllm-parts > /dev/null
# each bundle here: "<sha256> <release> <parts here> <parts>"
bundles() {
  python3 ci/transfer/parts.py status --store /tmp/vllm-parts | sed -E 's/^([0-9a-f]+) vllm-/\1 /'
}
unpacked=$(cat /tmp/site/.vllm-bundle 2>/dev/null || true)
# which complete bundle to unpack: the one of VLLM_RELEASE when it is not unpacked already; without VLLM_RELEASE
# the only complete one when none is unpacked yet (a bundle unpacked stays until VLLM_RELEASE names another, so that
# parts arriving while tests run never replace the vLLM under them)
want=
while read -r sum release have parts; do
  [ -n "$sum" ] || continue
  if [ "$have" -ne "$parts" ]; then
    echo "vLLM $release bundle: $have of $parts parts here so far"
  elif [ "$sum" = "$unpacked" ]; then
    :
  elif [ -n "${VLLM_RELEASE:-}" ] && [ "$release" = "$VLLM_RELEASE" ]; then
    want=$sum
  elif [ -z "${VLLM_RELEASE:-}" ] && [ -z "$unpacked" ]; then
    if [ -n "$want" ]; then
      echo "setup.sh: several complete vLLM bundles here ($(bundles | awk '$3 == $4 {print $2}' | tr '\n' ' '));" \
        "name one with VLLM_RELEASE=<release>" >&2
      exit 2
    fi
    want=$sum
  else
    echo "vLLM $release bundle: all $parts parts here (VLLM_RELEASE=$release ci/gpu/setup.sh unpacks it)"
  fi
done <<<"$(bundles)"
if [ -n "${VLLM_RELEASE:-}" ] && [ -z "$want" ] && ! [ "$(python3 ci/gpu/matrix_table.py --release 2>/dev/null)" = "$VLLM_RELEASE" ]; then
  echo "setup.sh: VLLM_RELEASE=$VLLM_RELEASE: no complete bundle of that release here (carry its .stage/vllm-$VLLM_RELEASE-* parts)" >&2
  exit 2
fi
# never under running steps (ci/gpu/bg.sh's: a pid without its exit status): their vLLM would go from under them
for pid in /tmp/bg/*.pid; do
  [ -n "$want" ] && [ -f "$pid" ] || continue
  if ! [ -f "${pid%.pid}.rc" ] && kill -0 "$(cat "$pid")" 2>/dev/null; then
    echo "setup.sh: $(basename "${pid%.pid}") still runs on the vLLM unpacked; wait for it (ci/gpu/bg.sh wait)" \
      "before VLLM_RELEASE=${VLLM_RELEASE:-} replaces that vLLM" >&2
    exit 2
  fi
done
if [ -n "$want" ]; then
  python3 ci/transfer/parts.py join "$want" --store /tmp/vllm-parts --out /tmp/vllm-slim.tar.xz
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
fi
# the wheels, once per set of wheels (runs in parallel must not reinstall under each other)
# (a wheel of a project the unpacked bundle carries is left out: the bundle holds its release's pin, e.g. 0.22.1's
# compressed-tensors 0.15.0.1 where a bundle that has none takes the 0.17.0 staged)
if compgen -G ".stage/whl/*.whl" >/dev/null; then
  stamp=$( (cat .stage/whl/*.whl; cat /tmp/site/.vllm-bundle 2>/dev/null || true) | sha256sum | cut -d' ' -f1)
  if [ "$(cat /tmp/site/.quantpack-wheels 2>/dev/null)" != "$stamp" ]; then
    wheels=()
    for w in .stage/whl/*.whl; do
      project=$(basename "$w" | cut -d- -f1)
      if grep -qix "${project}-.*\.dist-info" /tmp/site/.vllm-bundle-entries 2>/dev/null; then
        echo "left out $(basename "$w"): the vLLM bundle carries its own $project"
      else
        wheels+=("$w")
      fi
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}"
    echo "$stamp" > /tmp/site/.quantpack-wheels
    echo "installed: $(for w in "${wheels[@]}"; do basename "$w"; done | tr '\n' ' ')"
  fi
fi
if compgen -G ".stage/nox/*.whl" >/dev/null && ! [ -d /tmp/nox-site/nox ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/nox-site .stage/nox/*.whl
  echo "nox installed into /tmp/nox-site"
fi
# the extension's JIT build (below): running while its pid file names a live process group
building() { [ -f /tmp/ext-build.pid ] && kill -0 "$(cat /tmp/ext-build.pid)" 2>/dev/null; }
# torch's JIT build holds a lock file in its build folder while it runs; any other process that JIT-loads the extension
# waits for that file to go, forever where its builder was killed. One left by no running build goes
clear_stale_lock() {
  local lock
  for lock in "$TORCH_EXTENSIONS_DIR"/exllamav3_ext*/lock; do
    [ -e "$lock" ] || continue
    if building; then
      echo "exllamav3 extension: $lock belongs to the JIT build running (pid $(cat /tmp/ext-build.pid))"
    else
      rm -f "$lock"
      echo "exllamav3 extension: removed $lock, left by a JIT build that no longer runs"
    fi
  done
}
# stop the JIT build (its whole process group: python, ninja, nvcc), wait until it is gone, then clear its lock
stop_build() {
  local pid i
  pid=$(cat /tmp/ext-build.pid)
  kill -- -"$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
  for i in $(seq 20); do
    pgrep -g "$pid" >/dev/null 2>&1 || break
    sleep 0.5
  done
  pgrep -g "$pid" >/dev/null 2>&1 && kill -9 -- -"$pid" 2>/dev/null
  rm -f /tmp/ext-build.pid
  echo "stopped the JIT build started earlier"
  clear_stale_lock
}
clear_stale_lock
# a prebuilt extension (staged from an earlier build on an identical machine, see stage.sh) saves the build
if [ -f .stage/ext/exllamav3_ext.so.xz ] && ! [ -f /tmp/ext-built ]; then
  mkdir -p /tmp/ext-prebuilt
  xz -dc .stage/ext/exllamav3_ext.so.xz > /tmp/ext-prebuilt/exllamav3_ext.so
  if python3 -c "from quantpack_exl3.backends.exllamav3.extension import load_extension; load_extension()"; then
    touch /tmp/ext-built
    echo "exllamav3 extension: prebuilt one loaded"
    # a JIT build started by an earlier run (before the prebuilt one arrived) would only compete for the cores, and
    # its lock would hold up every later JIT load
    if building; then
      stop_build
    fi
    # a process started as vLLM starts its engine (multiprocessing's spawn) must load this file too, not JIT-build
    python3 ci/gpu/ext_check.py 120
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
from quantpack_core.trellis_mma.library import LibraryError, cache_dir, library_path
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
