#!/usr/bin/env bash
# The production-path smoke, one variant per call (PATCHED_SITE, STOCK_SITE, OUT, PAIR;
# TIME_LIMIT, KV_CACHE_MEMORY_BYTES, GPU_MEMORY_UTILIZATION, SMOKE_ARGS, SHARED_GPU).
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: production-smoke.sh default|eager|qwen3|warm|stock|stock-warm|fp8|tp2|ray|ray-tp2|seed|no-drafter-graphs|seed-no-graphs|step-graphs|seed-step-graphs|seed-full|pair|quick"
host smoke "$@"
