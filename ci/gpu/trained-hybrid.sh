#!/usr/bin/env bash
# The trained hybrid pair on one GPU host (tooling/trained/hybrid.py says what is judged).
#   trained-hybrid.sh train   start the recipe (tooling train --arch hybrid) in its own session
#   trained-hybrid.sh wait    wait for it (at most WAIT_S seconds, default 540)
#   trained-hybrid.sh CALL    one call of `tooling smoke --trained-hybrid` (1: the largest K
#                             with the plain engine; 2: the next K and the prefix-caching
#                             pair; 3: the speed pair), its engines at once on one GPU; then
#                             the report of every call so far
#   trained-hybrid.sh chain   wait, then every call (CALLS: only these, space-separated; an
#                             earlier session's results in $WORK/trained complete the
#                             report), into $WORK/results: longer than one device command,
#                             so start it under setsid and `collect` now and then
#   trained-hybrid.sh collect copy what the chain has written so far into $OUT
#   trained-hybrid.sh export-pair CALL
#                             the trained pair into $OUT, four parts of 15 MiB a device
#                             command (CALL 0, 1, ...: a command brings back 64 MiB), so
#                             a later session carries it in (pair-parts.sh here) and
#                             skips the training
#   trained-hybrid.sh import-pair PARTS
#                             join and check such carried parts into the pair's folder
# Needs host-setup.sh's installs: $ENGINES/patched, stock and the no-<patch> ablations
# hybrid_plan.SITES names (hybrid-session.sh passes them as ABLATIONS); the recipe trains
# with the bundle's dflash and flash-linear-attention and the payload's train-wheels/
# (make-parts.sh).
# Writes $OUT/trained-CALL.tar.gz (results and logs, no compile caches) and
# $OUT/trained-report-CALL.txt.
# TIME_LIMIT (seconds, default 540) bounds each engine process.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: trained-hybrid.sh train|wait|CALL|chain|collect|export-pair CALL|import-pair PARTS"
[ $# -gt 0 ] || usage_error "give a step"
step=$1
case $step in
  train|wait|chain|collect) [ $# -eq 1 ] || usage_error "$step takes no arguments" ;;
  export-pair) [ $# -eq 2 ] || usage_error "export-pair needs CALL"
    whole_number CALL "$2"
    required OUT "the folder this command brings back" ;;
  import-pair) [ $# -eq 2 ] || usage_error "import-pair needs PARTS"
    set -- "$1" "$(absolute "$2")" ;;
  *) [[ $step =~ ^[1-9][0-9]{0,2}$ ]] || usage_error "unknown step '$step'"
    [ $# -eq 1 ] || usage_error "CALL takes no more arguments"
    required OUT "the folder this command brings back" ;;
esac
[ "$step" != collect ] || required OUT "the folder this command brings back"
[ -z "${TIME_LIMIT:-}" ] || whole_number TIME_LIMIT "$TIME_LIMIT"
[ -z "${WAIT_S:-}" ] || whole_number WAIT_S "$WAIT_S"
# Paths the caller gave, made absolute before the script changes folder.
read -r -a more_wheels <<< "${TRAIN_WHEELS:-}"
for i in "${!more_wheels[@]}"; do more_wheels[i]=$(absolute "${more_wheels[i]}"); done
[[ ${CALLS:-} =~ ^[0-9\ ]{0,99}$ ]] ||
  refuse "CALLS must be call numbers separated by spaces, not '$CALLS'"
read -r -a calls <<< "${CALLS:-}"
. "$here/env.sh"
cd "$here/../.." || exit 1
pair=$WORK/hybrid-pair
runs=$WORK/trained
case $step in
  train)
    # A fresh folder: no package of an earlier run's wheels stays beside this run's.
    rm -rf "$WORK/train-extras" && mkdir -p "$WORK/train-extras"
    # TRAIN_ARGS: more recipe options (--set KEY=VALUE ...).
    read -r -a more <<< "${TRAIN_ARGS:-}"
    # install.sh installs vLLM's dependencies; the trainer's own extras are unpacked beside.
    for wheel in "$WORK"/joined/payload/bundle/wheels/{dflash,flash_linear_attention,fla_core}-*.whl; do
      [ -f "$wheel" ] && python3 -m zipfile -e "$wheel" "$WORK/train-extras"
    done
    # Wheels for the recipe alone, pip-installed (pip keeps their programs executable): the
    # payload's train-wheels/ (make-parts.sh: Triton 3.7.1, as flash-linear-attention's gated
    # backward refuses Hopper under older Triton, and vLLM's torch brings an older one) and
    # TRAIN_WHEELS, more wheels, each replacing the payload's wheel of its name.
    wheels=()
    for wheel in "$WORK"/joined/payload/train-wheels/*.whl; do
      [ -f "$wheel" ] || {
        echo "note: no train-wheels/ in the payload (parts of an older make-parts.sh, or TRAINING=0)"; continue; }
      name=${wheel##*/}
      [[ " ${more_wheels[*]##*/}" == *" ${name%%-*}-"* ]] || wheels+=("$wheel")
    done
    wheels+=("${more_wheels[@]}")
    if [ ${#wheels[@]} -gt 0 ]; then
      python3 -m pip install --quiet --no-deps --no-index --upgrade --target "$WORK/train-extras" \
        "${wheels[@]}" || exit 1
    fi
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$WORK/train-extras:$SITE \
      setsid nohup python3 -m tooling.trainer train --arch hybrid \
      --out-dir "$pair" --export "$WORK/train-out" "${more[@]}" \
      > "$WORK/train-hybrid.log" 2>&1 < /dev/null &
    echo "training started (pid $!), log $WORK/train-hybrid.log"
    exit 0 ;;
  wait)
    limit=${WAIT_S:-540}
    while pgrep -f "tooling.trainer train --arch hybrid" > /dev/null && [ "$limit" -gt 0 ]; do
      sleep 5; limit=$((limit - 5))
    done
    grep -v '^\[transformers\]' "$WORK/train-hybrid.log" 2>/dev/null | tail -25
    [ -n "${OUT:-}" ] && cp -r "$WORK/train-out" "$OUT/" 2>/dev/null
    [ -f "$pair/summary.json" ] || { echo "no trained pair (yet)"; exit 1; }
    du -sh "$pair"
    exit 0 ;;
  chain)
    export OUT=$WORK/results
    mkdir -p "$OUT"
    WAIT_S=${WAIT_S:-1200} bash "$here/trained-hybrid.sh" wait || exit 1
    # The plan's calls: one per K the recipe measured, then the speed pair's.
    last=$(PYTHONPATH=$SITE python3 -m tooling.trained.hybrid plan "$pair" "$runs" \
      | awk '{print $3}' | sort -n | tail -1) || exit 1
    [ -n "$last" ] || { echo "error: no calls planned on $pair" >&2; exit 1; }
    # Each call's report judges every result so far; a call that failed fails the chain.
    rc=0
    [ ${#calls[@]} -gt 0 ] || mapfile -t calls < <(seq 1 "$last")
    for call in "${calls[@]}"; do
      bash "$here/trained-hybrid.sh" "$call" || rc=$?
    done
    exit $rc ;;
  export-pair)
    call=$2
    [ -f "$pair/summary.json" ] || { echo "error: no trained pair in $pair" >&2; exit 1; }
    parts=$WORK/pair-parts
    if [ ! -f "$parts/SHA256SUMS" ]; then
      PYTHONPATH=$SITE python3 -m tooling.release.split "$pair" "$parts" $((15 << 20)) \
        > /dev/null || exit 1
    fi
    mapfile -t names < <(cd "$parts" && printf '%s\n' *.part-* | sort -V)
    last=$(( (${#names[@]} + 3) / 4 - 1 ))
    [ "$call" -le "$last" ] || { echo "error: CALL $call past the last, $last" >&2; exit 2; }
    for name in "${names[@]:$((call * 4)):4}"; do cp "$parts/$name" "$OUT/"; done
    [ "$call" -eq 0 ] && cp "$parts/SHA256SUMS" "$parts/join.py" "$OUT/"
    echo "pair parts: ${#names[@]}, four a command; this was CALL $call of 0..$last"
    exit 0 ;;
  import-pair)
    from=$2
    [ -f "$from/join.py" ] || refuse "$from/join.py: no such file (PARTS holds the pair's parts)"
    [ -e "$pair" ] && { echo "error: $pair is there already" >&2; exit 1; }
    # A fresh folder: nothing of an earlier, stopped import joins this one.
    rm -rf "$WORK/pair-import"
    python3 "$from/join.py" "$WORK/pair-import" > /dev/null || exit 1
    mv "$WORK/pair-import/$(basename "$pair")" "$pair" || exit 1
    rm -rf "$WORK/pair-import"
    echo "trained pair carried in: $(du -sh "$pair" | cut -f1)"
    exit 0 ;;
  collect)
    cp -r "$WORK"/results/trained-* "$WORK"/results/train-out "$OUT/" 2>/dev/null
    tail -5 "$WORK/train-hybrid.log" 2>/dev/null
    ls -la "$OUT"
    exit 0 ;;
esac
call=$step
mkdir -p "$runs"
start=$(date +%s)
PYTHONPATH=$SITE python3 -m tooling.trained.measure run-call "$pair" "$runs" "$call" \
  --engines-root "$ENGINES" --time-limit "${TIME_LIMIT:-540}" > "$OUT/trained-report-$call.txt"
rc=$?
echo "call $call: done in $(( $(date +%s) - start ))s"
cat "$OUT/trained-report-$call.txt"
# A pair carried in from an earlier session has no training output beside it.
kept=(trained); [ -d "$WORK/train-out" ] && kept+=(train-out)
tar -czf "$OUT/trained-$call.tar.gz" --exclude='vllm-cache-*' -C "$WORK" "${kept[@]}"
exit $rc
