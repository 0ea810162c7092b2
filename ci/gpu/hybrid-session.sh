#!/usr/bin/env bash
# One GPU session's work on the seed's family, in the background; collect and wait (OUT)
# bring back what it has written.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: hybrid-session.sh start PARTS [seed|seed-stock|tiny|tiny-no-graphs|seed-no-graphs|tiny-step-graphs|seed-step-graphs|ray|ray-tp2|seed-full|seed-full-quick|seed-full-pair|seed-full-pair-quick|pair|trained|trained-1|trained-1-state|trained-1-replay|speed|speed-locate|speed-16|speed-replay|speed-bar|speed-hold|speed-graphs|speed-stock|speed-shape|speed-shape-off|speed-shape-off-16|speed-shape-stock|speed-shape-stock-64|speed-inputs|speed-greedy|speed-context|speed-align|speed-step|speed-host|speed-one|speed-one-graphs|speed-seed|verify|kernels|fuzz-seed|fuzz-seed-full|fuzz-trained|fuzz-replay ...]|collect|wait SECONDS"
host session "$@"
