#!/usr/bin/env bash
# The trained hybrid pair on one GPU host (OUT; TIME_LIMIT, WAIT_S, CALLS, TRAIN_WHEELS,
# TRAIN_ARGS).
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: trained-hybrid.sh train|wait|CALL|chain|collect|export-pair CALL|import-pair PARTS"
host trained "$@"
