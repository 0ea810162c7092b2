#!/usr/bin/env bash
# Start the trained-drafter recipe in its own session (it outlives this command).
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: train-background.sh"
host train-background "$@"
