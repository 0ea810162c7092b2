#!/usr/bin/env bash
# The hybrid defects' proof on one GPU host, one call's engines at once (OUT).
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: [TIME_LIMIT=SECONDS] hybrid-proof.sh 1|2|3"
host proof "$@"
