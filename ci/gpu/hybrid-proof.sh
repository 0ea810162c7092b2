#!/usr/bin/env bash
# The hybrid defects' proof on one GPU host (tooling/trained/hybrid_proof.py says what it
# compares): the seed-shaped pair, each engine variant of one call in its own process, all
# at once on one GPU, each with its own compile cache and a fixed KV cache.
#   hybrid-proof.sh CALL   (1: the plain engine and the K=15 pair: first tokens, mixed steps,
#   max_model_len; 2: the K=3 pair and the K=15 engine without the GDN gate patch; 3: PIECEWISE
#   graphs under 64 concurrent requests). The report of a call compares every call so far.
# Needs host-setup.sh's installs ($ENGINES/patched, stock and no-gdn-gate-gather, with
# ABLATIONS=gdn-gate-gather). Writes $OUT/proof-CALL.tar.gz (requests, results, logs) and
# $OUT/report-CALL.txt. TIME_LIMIT (seconds, default 480) bounds each engine process.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: [TIME_LIMIT=SECONDS] hybrid-proof.sh 1|2|3"
[ $# -eq 1 ] || usage_error "give one CALL"
call=$1
case $call in
  1|2|3) ;;
  *) usage_error "unknown CALL '$call'" ;;
esac
required OUT "the folder this command brings back"
OUT=$(absolute "$OUT")
limit=${TIME_LIMIT:-480}
whole_number TIME_LIMIT "$limit"
. "$here/env.sh"
cd "$here/../.." || exit 1
proof=$WORK/proof
pair=$WORK/seed-pair
mkdir -p "$proof"
if [ ! -f "$pair/tiny.json" ]; then
  start=$(date +%s)
  PYTHONPATH=$SITE python3 -m tooling.smoke.serving.tiny "$pair" --arch seed --hidden-size 512 \
    > "$proof/pair.log" 2>&1 || { tail -20 "$proof/pair.log"; exit 1; }
  echo "seed-shaped pair written in $(( $(date +%s) - start ))s: $(du -sh "$pair" | cut -f1)"
fi
PYTHONPATH=$SITE python3 -m tooling.trained.hybrid_proof plan "$proof" \
  --target "$pair/target" --drafter "$pair/drafter" > "$proof/variants.txt" || exit 1
start=$(date +%s)
while read -r name site variant_call; do
  [ "$variant_call" = "$call" ] || continue
  VLLM_CACHE_ROOT=$WORK/vllm-cache-$name PYTHONPATH=$ENGINES/$site:$SITE \
    timeout --kill-after=15 "$limit" python3 -m tooling.smoke.serving.distribution \
    "$proof/$name.in.json" "$proof/$name.out.json" > "$proof/$name.log" 2>&1 &
done < "$proof/variants.txt"
wait
echo "call $call: engines done in $(( $(date +%s) - start ))s"
for f in "$proof"/*.out.json; do
  python3 - "$f" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
name = sys.argv[1].rsplit("/", 1)[-1]
if r.get("ok"):
    print(f"{name}: started in {r['startup_s']:.0f}s, {r['cudagraph_mode']}, "
          f"{r['num_gpu_blocks']} blocks, capture sizes {r['capture_sizes'][:6]}...")
else:
    print(f"{name}: {r.get('error')}")
PY
done
PYTHONPATH=$SITE python3 -m tooling.trained.hybrid_proof report "$proof" --through-call "$call" \
  > "$OUT/report-$call.txt"
rc=$?
cat "$OUT/report-$call.txt"
tar -czf "$OUT/proof-$call.tar.gz" -C "$WORK" proof
exit $rc
