#!/usr/bin/env bash
# Here (the .venv): the trained pair brought back by trained-hybrid.sh export-pair, split again.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: pair-parts.sh OUT_DIR [PART_SIZE_BYTES] -- DIR ..."
# shellcheck disable=SC2154  # repo: args.sh sets it
python=$repo/.venv/bin/python host pair-parts "$@"
