#!/usr/bin/env bash
# Start the trained-drafter recipe in its own session (it outlives this command).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: train-background.sh"
[ $# -eq 0 ] || usage_error "unknown argument '$1'"
. "$here/env.sh"
dflash=$(ls "$WORK"/joined/payload/bundle/wheels/dflash-*.whl)
python3 -m zipfile -e "$dflash" "$WORK/dflash-only"
cd "$here/../.."
# The host's own transformers (not the bundle's) for training: the reference
# package's cached loop needs it; only dflash comes from the bundle.
PYTHONPATH=$WORK/dflash-only setsid nohup python3 -m tooling.trainer train \
  --export "$WORK/train-out" > "$WORK/train.log" 2>&1 < /dev/null &
echo "training started (pid $!), log $WORK/train.log"
