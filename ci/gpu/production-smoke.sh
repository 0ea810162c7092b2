#!/usr/bin/env bash
# The production-path smoke on one GPU host, one variant per call (TIME_LIMIT below
# keeps a variant within a device command of bounded length).
#   PATCHED_SITE  pip --target folder: the wheel under test + the bundle's deps
#   STOCK_SITE    pip --target folder holding stock vLLM 0.20.1 (deps from PATCHED_SITE)
#   OUT           where reports and logs go
# Variants:
#   default  compiled + CUDA graphs, hybrid Qwen3.5-family target, concurrent
#            load on both servers, audited concurrent in-process batch (checks 1-6, 8, 9)
#   eager    the same with --enforce-eager
#   qwen3    the attention-only pair, compiled
#   warm     check 7: stock compiles into the cache first (A), then the wheel (B); C cold
#   stock    negative control on STOCK_SITE (--expect stock): checks 2-5 and 8 must fail
#   stock-warm  the same for check 7: the wheel under test compiles into the cache
#            first (A), then stock (B), which must fail it
#   fp8      --kv-cache-dtype fp8 (checks 1-4 must pass; fidelity reported)
#   tp2      --tensor-parallel-size 2 --disable-custom-all-reduce (a 2-GPU host)
#   ray      the seed-shaped pair at K = 15, its DFlash server on vLLM's Ray executor at
#            TP=1: on one GPU, Ray's workers and the synchronous spec-decode path Ray brings
#            (PATCHED_SITE needs Ray: make-parts.sh RAY=1)
#   ray-tp2  the same at TP=2 (a 2-GPU host)
#   seed     the seed-shaped pair (Qwen3.6-27B's depth, heads and vocabulary, z-lab's
#            drafter layout, hidden width narrowed) at K = 15
#   seed-full  the same at the seed's own hidden width (5120): about 56 GB of weights
#   pair     the pair in PAIR (PAIR/target, PAIR/drafter) at K = 15, as a user smokes their
#            own: --target and --drafter, no generated pair
#   quick    --quick: the checks one start of the engines answers
# `tooling smoke --dry-run --gpus COUNTxGIB` with the same options prints the plan a
# variant executes (which engines run where, in what order, with which limits).
# Optional: TIME_LIMIT (seconds; unset: the plan's own limits, which scale from the first
# engine's measured start: run a variant longer than one device command, such as seed-full,
# under setsid and poll it), KV_CACHE_MEMORY_BYTES (a fixed KV cache
# per engine: no memory profiling, for variants sharing one GPU) with
# GPU_MEMORY_UTILIZATION (then only the free memory each engine needs at start-up),
# SHARED_GPU=1 (production-smoke-all.sh: the other variants' processes are expected).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: production-smoke.sh default|eager|qwen3|warm|stock|stock-warm|fp8|tp2|ray|ray-tp2|seed|seed-full|pair|quick"
[ $# -eq 1 ] || usage_error "give one variant"
variant=$1
required PATCHED_SITE "the pip --target folder of the wheel under test"
required OUT "the folder reports and logs go to"
# Every path made absolute before the script changes folder (a relative one is the
# caller's), each folder of a colon-joined site too.
sites() {
  local IFS=: folders folder out=()
  read -r -a folders <<< "$1"
  for folder in "${folders[@]}"; do out+=("$(absolute "$folder")"); done
  printf '%s\n' "${out[*]}"
}
PATCHED_SITE=$(sites "$PATCHED_SITE")
OUT=$(absolute "$OUT")
site=$PATCHED_SITE
args=()
[ "$variant" = pair ] || args+=(--tiny)
backstop=()
if [ -n "${TIME_LIMIT:-}" ]; then
  # Digits only before the arithmetic below: bash would evaluate an expression in it.
  whole_number TIME_LIMIT "$TIME_LIMIT"
  args+=(--time-limit "$TIME_LIMIT")
  # Past the smoke's own limit: SIGTERM makes it stop its children (no report then).
  backstop=(timeout --kill-after=20 $((TIME_LIMIT + 40)))
fi
[ -n "${KV_CACHE_MEMORY_BYTES:-}" ] && args+=(--kv-cache-memory-bytes "$KV_CACHE_MEMORY_BYTES")
[ -n "${GPU_MEMORY_UTILIZATION:-}" ] && args+=(--gpu-memory-utilization "$GPU_MEMORY_UTILIZATION")
case $variant in
  warm|stock|stock-warm) required STOCK_SITE "the pip --target folder of stock vLLM 0.20.1"
    STOCK_SITE=$(sites "$STOCK_SITE") ;;
  pair) required PAIR "the folder holding target/ and drafter/"
    PAIR=$(absolute "$PAIR") ;;
esac
case $variant in
  default) ;;
  eager) args+=(--enforce-eager) ;;
  qwen3) args+=(--tiny-arch qwen3) ;;
  warm) args+=(--warm-cache --stock-site "$STOCK_SITE" --no-load --no-audit) ;;
  stock) site=$STOCK_SITE:$PATCHED_SITE; args+=(--expect stock --no-load) ;;
  stock-warm) site=$STOCK_SITE:$PATCHED_SITE
    args+=(--expect stock --warm-cache --stock-site "${PATCHED_SITE%%:*}" --no-load --no-audit) ;;
  fp8) args+=(--kv-cache-dtype fp8) ;;
  # 0.20.1's custom all-reduce faults capturing a hybrid DFlash server's graphs at TP=2
  # (stock too): the servers use NCCL's (docs/serving.md, "Two GPUs: TP=2").
  tp2) args+=(--tensor-parallel-size 2 --disable-custom-all-reduce) ;;
  # The DFlash server starts a Ray instance of its own; its workers inherit the server's
  # environment (env.sh's NCCL_NVLS_ENABLE=0 among it).
  ray) args+=(--tiny-arch seed --num-speculative-tokens 15 --distributed-executor-backend ray) ;;
  ray-tp2) args+=(--tiny-arch seed --num-speculative-tokens 15 --tensor-parallel-size 2
    --disable-custom-all-reduce --distributed-executor-backend ray) ;;
  seed) args+=(--tiny-arch seed --num-speculative-tokens 15) ;;
  seed-full) args+=(--tiny-arch seed --tiny-hidden-size 5120 --num-speculative-tokens 15) ;;
  pair) args+=(--target "$PAIR/target" --drafter "$PAIR/drafter" --num-speculative-tokens 15) ;;
  quick) args+=(--quick) ;;
  *) usage_error "unknown variant '$variant'" ;;
esac
# Offline, and NVLink multicast off for every child: the servers' workers, Ray's included.
. "$here/env.sh"
cd "$here/../.." || exit 1
mkdir -p "$OUT"
# SMOKE_ARGS: more `tooling smoke` options for any variant (e.g. --tiny-arch qwen3).
read -r -a more <<< "${SMOKE_ARGS:-}"
args+=("${more[@]}")
start=$(date +%s)
PYTHONPATH=$site "${backstop[@]}" \
  python3 -m tooling --no-progress smoke "${args[@]}" \
  --workdir "$OUT/$variant" --json > "$OUT/$variant.json" 2> "$OUT/$variant.err"
rc=$?
echo "production smoke $variant: exit $rc in $(( $(date +%s) - start ))s (report $OUT/$variant/report.json, logs $OUT/$variant/logs)"
# The check table; a smoke that wrote no report is one line, then its own last lines.
python3 -m tooling.smoke_summary "$OUT/$variant.json" || tail -3 "$OUT/$variant.err"
# Nothing may be left running: list any vLLM or Ray process this run left behind.
[ -n "${SHARED_GPU:-}" ] || pgrep -af "vllm.entrypoints|tooling.smoke|raylet|gcs_server|ray::" || true
exit $rc
