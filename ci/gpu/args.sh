# shellcheck shell=bash
# Sourced first by every script here, with its usage line (`. "$here/args.sh" "usage: ..."`):
# `host COMMAND "$@"` runs `tooling host COMMAND` (tooling/host/), which checks every argument
# and setting and does the step; a refusal names the script and this usage line. The host's
# python3 runs it from this checkout (docs/guide/gpu-steps.md); $python picks another.
usage=$1
# shellcheck disable=SC2154  # here: the folder of the script that sources this one
repo=$(cd "$here/../.." && pwd)
host() {
  local command=$1
  shift
  PYTHONPATH=$repo exec "${python:-python3}" -m tooling host --script "${0##*/}" \
    --usage "$usage" "$command" -- "$@"
}
