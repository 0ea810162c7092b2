#!/usr/bin/env bash
# Several production-smoke variants at once on one GPU, under one shared deadline
# (default: default, stock and fp8, for one device command of <= 9.5 minutes; then
# run `production-smoke.sh warm` alone). Prints each variant's check table at the end.
#   PATCHED_SITE, STOCK_SITE, OUT  as for production-smoke.sh
#   VARIANTS      default "default stock fp8"
#   TIME_LIMIT    each smoke's own limit, started together (default 500 s; the
#                 per-variant backstop kills at +40 s, +20 s more for SIGKILL)
# Each variant has its own workdir ($OUT/VARIANT: models, logs, VLLM_CACHE_ROOT) and
# picks its server ports from the kernel. Engines sharing the GPU get a fixed KV
# cache (KV_CACHE_MEMORY_BYTES, default 4 GiB): vLLM 0.20.1's start-up memory
# profiling asserts when a neighbour frees GPU memory meanwhile, and a fixed size
# skips it. GPU_MEMORY_UTILIZATION (default 0.1) is then only the free memory an
# engine needs to start: at most one engine per variant runs at a time.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: PATCHED_SITE=DIR STOCK_SITE=DIR OUT=DIR [VARIANTS=...] production-smoke-all.sh"
[ $# -eq 0 ] || usage_error "unknown argument '$1'"
required PATCHED_SITE "the pip --target folder of the wheel under test"
required STOCK_SITE "the pip --target folder of stock vLLM 0.20.1"
required OUT "the folder reports and logs go to"
export TIME_LIMIT=${TIME_LIMIT:-500} SHARED_GPU=1
whole_number TIME_LIMIT "$TIME_LIMIT"
export KV_CACHE_MEMORY_BYTES=${KV_CACHE_MEMORY_BYTES:-$((4 << 30))}
export GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.1}
mkdir -p "$OUT"
start=$(date +%s)
declare -A pids
for variant in ${VARIANTS:-default stock fp8}; do
  "$here/production-smoke.sh" "$variant" > "$OUT/$variant.summary" 2>&1 &
  pids[$variant]=$!
done
worst=0
for variant in "${!pids[@]}"; do
  wait "${pids[$variant]}"
  rc=$?
  (( rc > worst )) && worst=$rc
done
echo "all variants done in $(( $(date +%s) - start ))s"
for variant in ${VARIANTS:-default stock fp8}; do
  echo "=== $variant"
  cat "$OUT/$variant.summary"
done
# Nothing may be left running once every variant has stopped.
pgrep -af "vllm.entrypoints|tooling.smoke" || true
exit $worst
