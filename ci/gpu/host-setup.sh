#!/usr/bin/env bash
# Join the carried parts, install vLLM's dependencies, build and install every engine variant.
# [ABLATIONS=IDS] [PROBES=0]; `install` stops once the bundle is installed.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: host-setup.sh PARTS_DIR [all|install|build]"
host setup "$@"
