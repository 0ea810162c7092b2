#!/usr/bin/env bash
# tooling smoke --tiny on the patched and on the stock install at the same time.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: smoke-pair.sh"
[ $# -eq 0 ] || usage_error "unknown argument '$1'"
. "$here/env.sh"
cd "$here/../.." || exit 1
run() {  # name expect
  PYTHONPATH=$ENGINES/$1:$SITE python3 -m tooling --no-progress smoke --tiny --expect "$2" \
    --workdir "$WORK/smoke-$1" --gpu-memory-utilization 0.1 --json \
    > "$WORK/smoke-$1.json" 2> "$WORK/smoke-$1.err"
  echo "smoke $1 (expect $2): exit $?"
}
run patched fixed & run stock stock & wait
