#!/usr/bin/env bash
# A frozen copy of the code for detached GPU steps, which outlive the call that started them while each later call's
# checkout replaces the tree (ci/gpu/README.md, "Detached runs").
#   here:     ci/gpu/snapshot.sh --stage          HEAD's sources -> .stage/head/src.tgz (about 1 MB, carried to the GPU)
#   GPU, run: ci/gpu/snapshot.sh /tmp/qp          .stage/head/src.tgz + this checkout's fixtures/ -> /tmp/qp
# The copy is made beside DEST and moved into place only once whole, so a call cut short never leaves a DEST whose
# fixtures are half copied (run.py's jobs would then fail on missing pack files, not on the code).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
if [ "${1:-}" = "--stage" ]; then
  rm -rf .stage/head
  mkdir -p .stage/head
  git archive --format=tar.gz -o .stage/head/src.tgz HEAD packages benchmarks tests conftest.py ci pyproject.toml noxfile.py
  # the commit the GPU records name (ci/gpu/env.sh): HEAD, "-dirty" where tracked files differ from it (the snapshot
  # holds HEAD's files, but a run of the checkout beside it holds the working tree's)
  echo "$(git rev-parse HEAD)$(git diff --quiet HEAD -- || echo -dirty)" > .stage/head/commit
  echo "snapshot of $(git rev-parse --short HEAD): .stage/head/src.tgz ($(stat -c %s .stage/head/src.tgz) bytes)"
  exit 0
fi
dest=${1:?usage: ci/gpu/snapshot.sh --stage | DEST}
[ -f .stage/head/src.tgz ] || { echo "snapshot.sh: no .stage/head/src.tgz: run ci/gpu/snapshot.sh --stage here and carry .stage/head" >&2; exit 2; }
rm -rf "$dest.part"
mkdir -p "$dest.part"
tar xzf .stage/head/src.tgz -C "$dest.part"
cut -d- -f1 .stage/head/commit > "$dest.part/.quantpack-commit" 2>/dev/null || true  # the snapshot is HEAD's
cp -r fixtures "$dest.part/"
rm -rf "$dest"
mv "$dest.part" "$dest"
echo "snapshot in $dest: $(find "$dest" -type f | wc -l) files"
