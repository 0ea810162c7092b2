#!/usr/bin/env bash
# tooling smoke --tiny on the patched and on the stock install at the same time.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: smoke-pair.sh"
host smoke-pair "$@"
