#!/usr/bin/env bash
# Wait for the recipe, then measure every engine on the trained pair.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: [WAIT_S=SECONDS] acceptance.sh"
[ $# -eq 0 ] || usage_error "unknown argument '$1'"
[ -z "${WAIT_S:-}" ] || whole_number WAIT_S "$WAIT_S"
. "$here/env.sh"
cd "$here/../.." || exit 1
limit=${WAIT_S:-420}
while [ ! -f "$WORK/train-out/summary.json" ] && [ "$limit" -gt 0 ]; do
  if ! pgrep -f tooling.trainer > /dev/null; then break; fi
  sleep 5; limit=$((limit - 5))
done
tail -5 "$WORK/train.log"
engines=""
# Every engine host-setup.sh installed: patched, stock and the no-<patch id> ablations.
for dir in "$ENGINES"/*/; do e=$(basename "$dir"); engines="$engines --engine $e=$ENGINES/$e"; done
PYTHONPATH=$SITE python3 -m tooling --no-progress smoke --trained --workdir "$WORK/accept" $engines
echo "acceptance: exit $?"
