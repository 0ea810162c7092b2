#!/usr/bin/env bash
# Here: the trained hybrid pair brought back by `trained-hybrid.sh export-pair` (its parts of
# 15 MiB spread over several device commands' folders), checked and split again into parts
# a device command carries (default 60 MiB), for `PAIR_PARTS=... hybrid-session.sh start`.
#   pair-parts.sh OUT_DIR [PART_SIZE_BYTES] -- DIR ...
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: pair-parts.sh OUT_DIR [PART_SIZE_BYTES] -- DIR ..."
[ $# -ge 1 ] || usage_error "give OUT_DIR"
out=$(absolute "$1")
shift
size=62914560
if [ "${1:-}" != "--" ]; then
  [ $# -ge 1 ] || usage_error "give -- and the folders"
  size=$1
  shift
fi
[ "${1:-}" = "--" ] || usage_error "give -- before the folders"
shift
[ $# -gt 0 ] || usage_error "give the folders after --"
whole_number PART_SIZE_BYTES "$size"
[ "$size" -ge 1048576 ] || refuse "PART_SIZE_BYTES $size is under 1 MiB (1048576)"
[ ! -e "$out" ] || refuse "$out exists"
dirs=()
for dir in "$@"; do
  [ -d "$dir" ] || refuse "$dir is not a folder"
  dirs+=("$(absolute "$dir")")
done
cd "$here/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/in"
# A device command's folder may hold more than the parts (a report copied beside them): take
# its plain files only, and let join.py judge which belong.
for dir in "${dirs[@]}"; do
  find "$dir" -maxdepth 1 -type f -exec cp {} "$work/in/" \;
done
[ -f "$work/in/join.py" ] || refuse "no join.py in ${dirs[*]} (the first export's folder has it)"
# join.py checks every part against SHA256SUMS and the whole archive's digest.
python3 "$work/in/join.py" "$work/joined" > /dev/null
pair=$(find "$work/joined" -mindepth 1 -maxdepth 1 -type d)
[ -f "$pair/summary.json" ] || { echo "error: pair-parts.sh: no summary.json in the pair" >&2; exit 1; }
.venv/bin/python -m tooling.release.split "$pair" "$out" "$size" > /dev/null
ls "$out"
