#!/usr/bin/env bash
# Here: the trained hybrid pair brought back by `trained-hybrid.sh export-pair` (its parts of
# 15 MiB spread over several device commands' folders), checked and split again into parts
# a device command carries (default 60 MiB), for `PAIR_PARTS=... hybrid-session.sh start`.
#   pair-parts.sh OUT_DIR [PART_SIZE_BYTES] -- DIR ...
set -euo pipefail
usage="usage: pair-parts.sh OUT_DIR [PART_SIZE_BYTES] -- DIR ..."
out=${1:?$usage}
shift
size=62914560
if [ "${1:-}" != "--" ]; then size=${1:?$usage}; shift; fi
[ "${1:-}" = "--" ] || { echo "$usage" >&2; exit 2; }
shift
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
[ -e "$out" ] && { echo "error: pair-parts.sh: $out exists" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/in"
# A device command's folder may hold more than the parts (a report copied beside them): take
# its plain files only, and let join.py judge which belong.
for dir in "$@"; do
  [ -d "$dir" ] || { echo "error: pair-parts.sh: $dir is not a folder" >&2; exit 2; }
  find "$dir" -maxdepth 1 -type f -exec cp {} "$work/in/" \;
done
# join.py checks every part against SHA256SUMS and the whole archive's digest.
python3 "$work/in/join.py" "$work/joined" > /dev/null
pair=$(find "$work/joined" -mindepth 1 -maxdepth 1 -type d)
[ -f "$pair/summary.json" ] || { echo "error: pair-parts.sh: no summary.json in the pair" >&2; exit 1; }
.venv/bin/python -m tooling.release.split "$pair" "$out" "$size" > /dev/null
ls "$out"
