#!/usr/bin/env bash
# Here, on the build machine (its .venv): the parts host-setup.sh joins on the GPU host.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: [RAY=1] [TRAINING=0] [BASE=VERSION] make-parts.sh OUT_DIR [PART_SIZE_BYTES]"
# shellcheck disable=SC2154  # repo: args.sh sets it
python=$repo/.venv/bin/python host make-parts "$@"
