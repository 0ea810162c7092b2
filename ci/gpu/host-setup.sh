#!/usr/bin/env bash
# Join the carried parts, install vLLM's dependencies, build and install every engine variant.
#   host-setup.sh PARTS_DIR [all|install|build]
# `install` stops once vLLM's dependencies are in $SITE (enough for trained-hybrid.sh train,
# which can then run while `build` makes the engines' installs).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: host-setup.sh PARTS_DIR [all|install|build]"
[ $# -ge 1 ] && [ $# -le 2 ] || usage_error "give PARTS_DIR and at most a step"
parts=$(absolute "$1")
step=${2:-all}
case $step in
  all|install|build) ;;
  *) usage_error "unknown step '$step'" ;;
esac
[ "$step" = build ] || [ -f "$parts/join.py" ] ||
  refuse "$parts/join.py: no such file (PARTS_DIR holds the parts make-parts.sh made)"
. "$here/env.sh"
mkdir -p "$WORK" "$ENGINES" "$VLLM_DFLASH_CACHE/pypi"
payload=$WORK/joined/payload
if [ "$step" != build ]; then
  python3 "$parts/join.py" "$WORK/joined"
  [ -f "$payload/bundle/install.sh" ] && [ -f "$payload/vllm-0.20.1.tar.gz" ] || {
    echo "error: $payload: expected bundle/install.sh and vllm-0.20.1.tar.gz (parts made by make-parts.sh)" >&2
    exit 2; }
  sh "$payload/bundle/install.sh" --target "$SITE" > "$WORK/install.log" 2>&1 || {
    tail -20 "$WORK/install.log"; exit 1; }
fi
[ "$step" = install ] && exit 0
official=$(ls "$payload"/bundle/wheels/vllm-0.20.1-*.whl)
cp "$official" "$payload"/vllm-0.20.1.tar.gz "$VLLM_DFLASH_CACHE/pypi/"
export PYTHONPATH=$SITE
cd "$here/../.."
# The patched wheel, with the probes (this interpreter plus $SITE is the probe
# interpreter) unless PROBES=0 (the CPU build machine probed the same sources;
# compare the sha256 printed below with its own, as
# docs/results/2026-12-01-reproducibility.md did), then
# the ablations (ABLATIONS, default: one per patch of the series, see below).
probes=(--probe-python "$(command -v python3)")
[ "${PROBES:-1}" = 0 ] && probes=(--no-probes)
python3 -m tooling --offline --no-progress build --dist "$WORK/dist" "${probes[@]}" \
  --json > "$WORK/build-patched.json"
install() { python3 -m pip install --quiet --no-deps --no-index --target "$ENGINES/$1" "$2"; }
install stock "$official"
install patched "$(ls "$WORK"/dist/vllm-*.whl)"
# One ablation per patch (ABLATIONS: these ids, empty: none; unset: every patch of the
# series): it and every patch written on it (series.toml `requires`), as comma-joined ids;
# the engine is named after the first.
all=$(python3 - <<'PY'
import os, tomllib
patches = tomllib.load(open("patches/series.toml", "rb"))["patch"]
known = [p["id"] for p in patches]
given = os.environ.get("ABLATIONS")
asked = known if given is None else [a.split(",")[0] for a in given.split()]
for pid in asked:
    if pid not in known:
        raise SystemExit(f"error: ABLATIONS: {pid} is not a patch of the series")
    print(",".join([pid] + [q["id"] for q in patches if pid in q.get("requires", [])]))
PY
)
for ablation in $all; do
  name=${ablation%%,*}
  skips=()
  for id in ${ablation//,/ }; do skips+=(--skip "$id"); done
  python3 -m tooling --offline --no-progress build --dist "$WORK/dist-$name" "${skips[@]}" \
    --no-probes --json > "$WORK/build-no-$name.json"
  install "no-$name" "$(ls "$WORK/dist-$name"/vllm-*.whl)"
done
sha256sum "$WORK"/dist*/vllm-*.whl
python3 - <<'PY'
import json, os
b = json.load(open(os.environ["WORK"] + "/build-patched.json"))
print("patched:", b["filename"], b["sha256"], [(p["id"], p["status"], p["probe"]) for p in b["patches"]])
PY
