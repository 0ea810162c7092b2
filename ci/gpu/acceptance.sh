#!/usr/bin/env bash
# Wait for the recipe, then measure every engine on the trained pair.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: [WAIT_S=SECONDS] acceptance.sh"
host acceptance "$@"
