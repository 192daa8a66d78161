# Sourced by scripts/setup-env and scripts/test: find_uv sets $uv to a uv binary, the one on PATH or else this
# checkout's own under .tools/ (fetched there on first use by bootstrap_uv.py, run with any Python >= 3.10 on PATH,
# the system's externally managed one included: nothing is installed into that Python). Needs $root.
QUANTPACK_UV_VERSION=0.13.9

find_uv() {
  if command -v uv >/dev/null 2>&1; then
    uv=$(command -v uv)
    return
  fi
  local tools="$root/.tools/uv-$QUANTPACK_UV_VERSION" py
  if [ -x "$tools/bin/uv" ]; then
    uv="$tools/bin/uv"
    return
  fi
  for py in python3 python; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
      echo "$(basename "$0"): no uv on PATH; fetching uv $QUANTPACK_UV_VERSION into $tools (for this checkout only;" \
        "$(command -v "$py") is left as it is)" >&2
      if ! uv=$("$py" -B "$root/scripts/lib/bootstrap_uv.py" "$tools" "$QUANTPACK_UV_VERSION"); then
        echo "$(basename "$0"): could not fetch uv; install uv (its documentation lists the ways) and run this again" >&2
        exit 1
      fi
      return
    fi
  done
  echo "$(basename "$0"): needs uv, or a Python >= 3.10 on PATH (python3 or python) to fetch it with" >&2
  exit 1
}
