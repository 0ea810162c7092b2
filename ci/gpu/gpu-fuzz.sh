#!/usr/bin/env bash
# The GPU fuzzer on one GPU host: one engine install on one pair, its findings into OUT.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: OUT=DIR [TIME_LIMIT=SECONDS] [NOISE=X] [FUZZ_ARGS=...] gpu-fuzz.sh patched|stock trained|seed|seed-full"
host fuzz "$@"
