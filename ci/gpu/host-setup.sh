#!/usr/bin/env bash
# Join the carried parts, install vLLM's dependencies, build and install every engine variant.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/env.sh"
parts=${1:?usage: host-setup.sh PARTS_DIR}
mkdir -p "$WORK" "$ENGINES" "$VLLM_DFLASH_CACHE/pypi"
python3 "$parts/join.py" "$WORK/joined"
payload=$WORK/joined/payload
sh "$payload/bundle/install.sh" --target "$SITE" > "$WORK/install.log" 2>&1 || {
  tail -20 "$WORK/install.log"; exit 1; }
official=$(ls "$payload"/bundle/wheels/vllm-0.20.1-*.whl)
cp "$official" "$payload"/vllm-0.20.1.tar.gz "$VLLM_DFLASH_CACHE/pypi/"
export PYTHONPATH=$SITE
cd "$here/../.."
# The patched wheel, with the probes (this interpreter plus $SITE is the probe
# interpreter) unless PROBES=0 (the CPU build machine probed the same bytes: the
# build is reproducible, so the sha256 printed below must equal its own), then
# one ablation per patch id in ABLATIONS (default: every patch of the series).
probes=(--probe-python "$(command -v python3)")
[ "${PROBES:-1}" = 0 ] && probes=(--no-probes)
python3 -m tooling --offline --no-progress build --dist "$WORK/dist" "${probes[@]}" \
  --json > "$WORK/build-patched.json"
install() { python3 -m pip install --quiet --no-deps --no-index --target "$ENGINES/$1" "$2"; }
install stock "$official"
install patched "$(ls "$WORK"/dist/vllm-*.whl)"
all=$(python3 -c 'import tomllib; print(" ".join(p["id"] for p in tomllib.load(open("patches/series.toml", "rb"))["patch"]))')
for skip in ${ABLATIONS-$all}; do
  python3 -m tooling --offline --no-progress build --dist "$WORK/dist-$skip" --skip "$skip" \
    --no-probes --json > "$WORK/build-no-$skip.json"
  install "no-$skip" "$(ls "$WORK/dist-$skip"/vllm-*.whl)"
done
sha256sum "$WORK"/dist*/vllm-*.whl
python3 - <<'PY'
import json, os
b = json.load(open(os.environ["WORK"] + "/build-patched.json"))
print("patched:", b["filename"], b["sha256"], [(p["id"], p["status"], p["probe"]) for p in b["patches"]])
PY
