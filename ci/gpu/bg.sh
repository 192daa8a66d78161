#!/usr/bin/env bash
# Long GPU-tier work across runs of at most 10 minutes (GPU machine, repo root). See ci/gpu/README.md.
#
#   ci/gpu/bg.sh start NAME CMD...    start CMD detached (setsid) with ci/gpu/env.sh; log /tmp/bg/NAME.log, exit
#                                     status /tmp/bg/NAME.rc once it ends
#   ci/gpu/bg.sh wait SECONDS NAME... wait until every NAME has ended or SECONDS passed; print each log's tail and
#                                     status; exit 0 when all ended with 0, 3 while any still runs, else 1
#   ci/gpu/bg.sh copy DIR NAME...     copy the logs (and any NAME.* result files) to DIR, e.g. $OUT
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
mkdir -p /tmp/bg
running() { [ -f "/tmp/bg/$1.pid" ] && ! [ -f "/tmp/bg/$1.rc" ] && kill -0 "$(cat "/tmp/bg/$1.pid")" 2>/dev/null; }
case "${1:-}" in
  start)
    name=$2
    shift 2
    if running "$name"; then
      echo "bg.sh: $name is already running (pid $(cat "/tmp/bg/$name.pid"))" >&2
      exit 2
    fi
    rm -f "/tmp/bg/$name.rc" "/tmp/bg/$name.log"
    printf '%q ' "$@" > "/tmp/bg/$name.cmd"
    setsid bash -c "source ci/gpu/env.sh; bash /tmp/bg/$name.cmd > /tmp/bg/$name.log 2>&1; echo \$? > /tmp/bg/$name.rc" \
      > /dev/null 2>&1 < /dev/null &
    echo $! > "/tmp/bg/$name.pid"
    echo "started $name: $*"
    ;;
  wait)
    deadline=$(( $(date +%s) + $2 ))
    shift 2
    while :; do
      busy=0
      for n in "$@"; do running "$n" && busy=1; done
      [ "$busy" = 0 ] || [ "$(date +%s)" -ge "$deadline" ] && break
      sleep 5
    done
    status=0
    for n in "$@"; do
      echo "=== $n: $(if [ -f "/tmp/bg/$n.rc" ]; then echo "ended, rc $(cat "/tmp/bg/$n.rc")"; elif running "$n"; then echo running; else echo "not started or lost"; fi)"
      tail -n "${TAIL:-40}" "/tmp/bg/$n.log" 2>/dev/null || true
      if running "$n"; then status=3; elif [ "$(cat "/tmp/bg/$n.rc" 2>/dev/null || echo 1)" != 0 ] && [ "$status" != 3 ]; then status=1; fi
    done
    exit "$status"
    ;;
  copy)
    dest=$2
    shift 2
    mkdir -p "$dest"
    for n in "$@"; do cp /tmp/bg/"$n".* "$dest"/ 2>/dev/null || true; done
    ;;
  *)
    sed -n '2,8p' "$0"
    exit 2
    ;;
esac
