#!/usr/bin/env bash
# Several production-smoke variants at once on one GPU, under one deadline (TIME_LIMIT).
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: PATCHED_SITE=DIR STOCK_SITE=DIR OUT=DIR [VARIANTS=...] production-smoke-all.sh"
host smoke-all "$@"
