#!/usr/bin/env bash
# One H200 session's GPU work on the seed's family, in the background: longer than one device
# command, so every step after the install runs under setsid and later commands collect.
#   hybrid-session.sh start PARTS   join and install the bundle, start the trained hybrid
#                                   pair's recipe, then the rest below in its own session
#   hybrid-session.sh collect       where it stands, and what has finished, into $OUT
# The rest, one after another while the recipe trains: the engines' installs
# (host-setup.sh build), the seed-shaped smoke on the fixed wheel (production-smoke.sh seed),
# the same pair on stock with --quick (--expect stock: its first tokens of K+1-token prompts
# must be wrong); then the trained pair's calls (trained-hybrid.sh chain), once it is written.
# The smokes share the GPU with the training: their wall times are upper bounds.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/env.sh"
step=${1:?usage: hybrid-session.sh start PARTS|collect}
session=$WORK/session
mark() { echo "[$(date +%T)] $*"; }
case $step in
  start)
    parts=${2:?usage: hybrid-session.sh start PARTS}
    mkdir -p "$session"
    bash "$here/host-setup.sh" "$parts" install || exit 1
    bash "$here/trained-hybrid.sh" train || exit 1
    setsid nohup bash "$here/hybrid-session.sh" background "$parts" \
      > "$session/session.log" 2>&1 < /dev/null &
    echo "session started (pid $!), log $session/session.log"
    ;;
  background)
    parts=${2:?}
    mark "building the engines' installs"
    PROBES=0 ABLATIONS="dflash-layer-id-offset dflash-swa-config eagle-cache-drop" \
      bash "$here/host-setup.sh" "$parts" build > "$session/build.log" 2>&1 || {
      mark "build failed: $session/build.log"; exit 1; }
    export PATCHED_SITE=$ENGINES/patched:$SITE STOCK_SITE=$ENGINES/stock SHARED_GPU=1
    mark "seed-shaped smoke, fixed wheel"
    OUT=$session/seed bash "$here/production-smoke.sh" seed > "$session/seed.txt" 2>&1
    mark "seed-shaped smoke, fixed wheel: exit $?"
    OUT=$session/seed-stock SMOKE_ARGS="--tiny-arch seed --num-speculative-tokens 15 --quick" \
      bash "$here/production-smoke.sh" stock > "$session/seed-stock.txt" 2>&1
    mark "seed-shaped smoke, stock --quick: exit $?"
    bash "$here/trained-hybrid.sh" chain > "$session/trained.txt" 2>&1
    mark "trained pair: exit $?"
    ;;
  collect)
    : "${OUT:?}"
    cat "$session/session.log" 2>/dev/null
    grep -v '^\[transformers\]' "$WORK/train-hybrid.log" 2>/dev/null | tail -3
    # A device command brings back at most eight files: the texts to read, the rest packed.
    cp "$session"/*.txt "$OUT/" 2>/dev/null
    cp "$WORK"/results/trained-report-*.txt "$OUT/" 2>/dev/null
    tar -czf "$OUT/session.tgz" --exclude='vllm-cache*' --exclude='models' -C "$WORK" \
      session results train-out 2>/dev/null
    ls -la "$OUT"
    ;;
  *)
    echo "usage: hybrid-session.sh start PARTS|collect" >&2
    exit 2
    ;;
esac
