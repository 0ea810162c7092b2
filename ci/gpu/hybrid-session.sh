#!/usr/bin/env bash
# One H200 session's GPU work on the seed's family, in the background: longer than one device
# command, so every step after the install runs under setsid and later commands collect.
#   hybrid-session.sh start PARTS [STEP ...]  join and install the bundle, start the trained
#                                   hybrid pair's recipe if `trained` is asked for, then the
#                                   engines' installs and the STEPs, one after another, in a
#                                   session of their own
#   hybrid-session.sh collect       where it stands, and what has finished, into $OUT
#   hybrid-session.sh wait SECONDS  wait for the session to end, at most SECONDS, then say
#                                   whether it still runs, its smoke's last progress lines,
#                                   and collect: one device command's whole turn
# STEPs, in the order given (default: seed seed-stock trained, what fits one session's 30
# device minutes with the recipe's training beside the smokes):
#   seed        production-smoke.sh seed: the seed-shaped pair at K = 15 on the fixed wheel
#   seed-stock  the same pair on stock with --quick (--expect stock: its first tokens of
#               K+1-token prompts must be wrong)
#   tiny        production-smoke.sh default: the --tiny hybrid default
#   ray         production-smoke.sh ray: the seed-shaped pair's servers on Ray at TP=1
#               (parts made with RAY=1 make-parts.sh)
#   ray-tp2     the same at TP=2 (a 2-GPU host)
#   seed-full   production-smoke.sh seed-full: the pair at the seed's width, 57 GB on the
#               host's disk, so with no ablation installs beside it (ask for it without
#               `trained`, and first: the steps before it leave their logs and caches)
#   seed-full-quick  the same with --quick: the first-token engines alone, one at a time
#   seed-full-pair  the 5120-wide pair drawn once on the GPU, then smoked as a user's own
#               pair (--target/--drafter), every check
#   seed-full-pair-quick  the same with --quick, then bench/bench_reference.py on the pair
#               and on that run's proposals: where the reference comparison's time goes
#   pair        the recipe alone: wait for it to write the pair (trained-hybrid.sh
#               export-pair then brings the pair back for a later session); the steps
#               after it run once it has ended, alone on the GPU
#   trained     trained-hybrid.sh chain: the trained pair's calls, once its recipe (started
#               first, beside the steps before it) has written the pair; with PAIR_PARTS (a
#               folder of an earlier session's pair, carried in: trained-hybrid.sh
#               export-pair, pair-parts.sh) that pair, and no training
# A smoke beside the training shares the GPU with it: its wall time is an upper bound.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
. "$here/args.sh" "usage: hybrid-session.sh start PARTS [seed|seed-stock|tiny|ray|ray-tp2|seed-full|seed-full-quick|seed-full-pair|seed-full-pair-quick|pair|trained ...]|collect|wait SECONDS"
[ $# -gt 0 ] || usage_error "give a command"
step=$1
case $step in
  start) [ $# -ge 2 ] || usage_error "start needs PARTS" ;;
  collect) [ $# -eq 1 ] || usage_error "collect takes no arguments" ;;
  wait) [ $# -eq 2 ] || usage_error "wait needs SECONDS"
    whole_number SECONDS "$2" ;;
  background) ;;
  *) usage_error "unknown command '$step'" ;;
esac
[ "$step" = start ] || [ "$step" = background ] || required OUT "the folder this command brings back"
# The session's process, recorded with its start time: a pid the kernel hands to another
# process once the session has ended is not taken for the session (tooling/pidfile.py).
pidfile() { PYTHONPATH=$repo python3 -m tooling.pidfile "$@"; }
. "$here/env.sh"
session=$WORK/session
mark() { echo "[$(date +%T)] $*"; }
case $step in
  start)
    parts=$(absolute "$2")
    [ -z "${PAIR_PARTS:-}" ] || PAIR_PARTS=$(absolute "$PAIR_PARTS")
    shift 2
    steps=("$@")
    [ ${#steps[@]} -gt 0 ] || steps=(seed seed-stock trained)
    for s in "${steps[@]}"; do
      case $s in
        seed|seed-stock|tiny|ray|ray-tp2|seed-full|seed-full-quick|seed-full-pair|seed-full-pair-quick|pair|trained) ;;
        *) usage_error "unknown step '$s'" ;;
      esac
    done
    [[ " ${steps[*]} " == *" trained "* && " ${steps[*]} " == *" seed-full"* ]] && {
      echo "error: hybrid-session.sh: seed-full's 57 GB leave no disk for trained's installs: one per session" >&2
      exit 2; }
    # A second start would reinstall the site the running session imports from.
    if [ -f "$session/background.pid" ] && running=$(pidfile check "$session/background.pid" 2>/dev/null); then
      echo "error: $session: a session is already running (pid $running): wait for it" >&2
      exit 2
    fi
    mkdir -p "$session"
    bash "$here/host-setup.sh" "$parts" install || exit 1
    if [[ " ${steps[*]} " == *" trained "* || " ${steps[*]} " == *" pair "* ]]; then
      if [ -n "${PAIR_PARTS:-}" ]; then
        bash "$here/trained-hybrid.sh" import-pair "$PAIR_PARTS" || exit 1
      else
        bash "$here/trained-hybrid.sh" train || exit 1
      fi
    fi
    # Without this command's OUT: the device hands every command a folder to bring back, and
    # a step that wrote there from the background would fill a later command's (its eight
    # files), crowding out what that command was run to bring back.
    setsid nohup env -u OUT bash "$here/hybrid-session.sh" background "$parts" "${steps[@]}" \
      > "$session/session.log" 2>&1 < /dev/null &
    pidfile record "$session/background.pid" $! || exit 1
    echo "session started (pid $!): ${steps[*]}; log $session/session.log"
    ;;
  background)
    parts=${2:?}
    shift 2
    # Only the trained pair's calls serve the ablations: the no-<patch> installs its plan uses.
    ablations=""
    if [[ " $* " == *" trained "* ]]; then
      ablations=$(cd "$here/../.." && PYTHONPATH=$SITE python3 -c \
        'from tooling.trained.hybrid_plan import SITES; print(*(s[3:] for s in SITES if s.startswith("no-")))') \
        || { mark "no ablation list: tooling.trained.hybrid_plan does not import"; exit 1; }
    fi
    mark "building the engines' installs"
    PROBES=0 ABLATIONS=$ablations bash "$here/host-setup.sh" "$parts" build \
      > "$session/build.log" 2>&1 || { mark "build failed: $session/build.log"; exit 1; }
    export PATCHED_SITE=$ENGINES/patched:$SITE STOCK_SITE=$ENGINES/stock
    for s in "$@"; do
      # Beside the recipe's training the GPU holds its processes too; alone, each smoke
      # lists any vLLM or Ray process it left behind. `pair` only waits for the training.
      if [ "$s" != pair ] && pgrep -f "tooling.trainer train --arch hybrid" > /dev/null; then
        export SHARED_GPU=1
      else
        unset SHARED_GPU
      fi
      mark "$s${SHARED_GPU:+ (beside the training)}"
      case $s in
        seed-stock)
          OUT=$session/seed-stock SMOKE_ARGS="--tiny-arch seed --num-speculative-tokens 15 --quick" \
            bash "$here/production-smoke.sh" stock > "$session/seed-stock.txt" 2>&1 ;;
        tiny)
          OUT=$session/tiny bash "$here/production-smoke.sh" default > "$session/tiny.txt" 2>&1 ;;
        seed-full-quick)
          OUT=$session/$s SMOKE_ARGS=--quick bash "$here/production-smoke.sh" seed-full \
            > "$session/$s.txt" 2>&1 ;;
        seed-full-pair|seed-full-pair-quick)
          pair=$session/seed-5120
          began=$SECONDS
          PYTHONPATH=$PATCHED_SITE:$here/../.. python3 -m tooling.smoke.serving.tiny "$pair" --arch seed \
            --hidden-size 5120 --device cuda > "$session/draw.txt" 2>&1
          rc=$?
          mark "the pair drawn on the GPU: exit $rc in $((SECONDS - began))s"
          if [ $rc -eq 0 ] && [ "$s" = seed-full-pair ]; then
            OUT=$session/$s PAIR=$pair bash "$here/production-smoke.sh" pair > "$session/$s.txt" 2>&1
            rc=$?
          elif [ $rc -eq 0 ]; then
            OUT=$session/$s PAIR=$pair SMOKE_ARGS=--quick bash "$here/production-smoke.sh" pair \
              > "$session/$s.txt" 2>&1
            mark "the pair's quick smoke: exit $?"
            PYTHONPATH=$PATCHED_SITE:$here/../.. timeout 480 python3 "$here/../../bench/bench_reference.py" \
              --target "$pair/target" --drafter "$pair/drafter" \
              --engine-result "$session/$s/pair/engine.json" --json "$session/bench-reference.json" \
              > "$session/bench-reference.txt" 2>&1
            rc=$?
          fi
          # The step's status is the draw's or the smoke's, not that of the assignment above.
          (exit $rc) ;;
        pair)
          WAIT_S=${WAIT_S:-1500} bash "$here/trained-hybrid.sh" wait > "$session/pair.txt" 2>&1 ;;
        trained)
          bash "$here/trained-hybrid.sh" chain > "$session/trained.txt" 2>&1 ;;
        *)
          OUT=$session/$s bash "$here/production-smoke.sh" "$s" > "$session/$s.txt" 2>&1 ;;
      esac
      rc=$?
      mark "$s: exit $rc"
      # A generated pair's weights go once its step has ended (its manifest, config and
      # the reports stay): a later step, seed-full's 57 GB above all, needs the disk.
      find "$session/$s" -path '*/models/*' -name '*.safetensors' -delete 2> /dev/null
    done
    ;;
  collect)
    cat "$session/session.log" 2>/dev/null
    grep -v '^\[transformers\]' "$WORK/train-hybrid.log" 2>/dev/null | tail -3
    # A device command brings back at most eight files of at most 16 MiB: every step's text
    # in one file to read, and the reports packed without the engines' logs, features and
    # compile caches (with those, one seed-shaped smoke's folder alone is over the limit).
    for text in "$session"/*.txt "$WORK"/results/trained-report-*.txt; do
      [ -f "$text" ] && printf '== %s\n%s\n\n' "${text#"$WORK"/}" "$(cat "$text")"
    done > "$OUT/texts.txt"
    (cd "$WORK" && find session results train-out trained \( -name '*.json' -o -name '*.txt' \) \
      -size -4M -not -path '*vllm-cache*' 2>/dev/null) |
      tar -czf "$OUT/reports.tgz" -C "$WORK" -T - 2>/dev/null
    # The processes' logs apart: they time a run's steps, and if they are over what a command
    # brings back, only they are left out.
    (cd "$WORK" && find session trained \( -name '*.log' -o -name '*.err' \) -size -8M \
      -not -path '*vllm-cache*' 2>/dev/null) |
      tar -czf "$OUT/logs.tgz" -C "$WORK" -T - 2>/dev/null
    ls -la "$OUT"
    ;;
  wait)
    # Every call collects: the device gives the machine back after 30 s idle, so a call that
    # only waited would lose, with the machine, everything since the last one that collected.
    limit=$2
    [ -f "$session/background.pid" ] ||
      refuse "$session/background.pid: no session was started here"
    pidfile check "$session/background.pid" > /dev/null
    [ $? -eq 2 ] && exit 2
    end=$((SECONDS + limit))
    while pidfile check "$session/background.pid" > /dev/null && [ $SECONDS -lt $end ]; do
      sleep 2
    done
    state=ended
    pidfile check "$session/background.pid" > /dev/null && state=running
    bash "$here/hybrid-session.sh" collect > "$OUT/collect.txt" 2>&1
    cat "$session/session.log" 2>/dev/null
    latest=$(ls -t "$session"/*/*.err 2>/dev/null | head -1)
    [ -n "$latest" ] && grep -h '^\[smoke\]' "$latest" | tail -8
    echo "session: $state"
    ;;
esac
