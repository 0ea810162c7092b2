#!/usr/bin/env bash
# Here, on the build machine: the parts host-setup.sh joins on the GPU host.
#   [RAY=1] [TRAINING=0] make-parts.sh OUT_DIR [PART_SIZE_BYTES]   (default 60 MiB, under
#   the transfer limit)
# The payload is what host-setup.sh reads: bundle/ (the contents of the one folder
# `tooling bundle` writes) and the vLLM sdist the ablations are built from. The bundle
# carries the toolchain's GPU-host extras: the reference dflash, GitPython for the
# offline builds, and flash-linear-attention for the hybrid recipe's training.
# train-wheels/ holds the wheels trained-hybrid.sh installs for the recipe alone.
# RAY=1 adds Ray (the pin tooling/smoke/config.py RAY_VERSION names), for the smoke's
# `--distributed-executor-backend ray` (production-smoke.sh ray-tp2): one wheel of about
# 67 MiB, so one or two parts more; its dependencies are the host's or the bundle's
# already (--extra adds a wheel without them). TRAINING=0 leaves train-wheels/ out (about
# 200 MB, three or four parts) for a session that runs smokes alone: trained-hybrid.sh says
# so when it finds none.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/args.sh" "usage: [RAY=1] [TRAINING=0] make-parts.sh OUT_DIR [PART_SIZE_BYTES]"
[ $# -ge 1 ] && [ $# -le 2 ] || usage_error "give OUT_DIR and at most a part size"
out=$(absolute "$1")
size=${2:-62914560}
# Checked before the bundle is made, not after (minutes, a network's worth of wheels).
whole_number PART_SIZE_BYTES "$size"
[ "$size" -ge 1048576 ] || refuse "PART_SIZE_BYTES $size is under 1 MiB (1048576)"
[ ! -e "$out" ] || refuse "$out exists: give a new folder for the parts"
cd "$here/../.."
cache=${VLLM_DFLASH_CACHE:-$HOME/.cache/vllm-dflash}
wheel=$(ls "$cache"/pypi/vllm-0.20.1-*.whl)
# One folder for everything this run writes, pip's and every child's temp folders too
# (TMPDIR): it goes on any exit, a signal's included.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
stop_on_signals
export TMPDIR=$work/tmp
mkdir "$TMPDIR"
extras=()
if [ "${RAY:-0}" = 1 ]; then
  ray=$(.venv/bin/python -c 'from tooling.smoke.config import RAY_VERSION; print(RAY_VERSION)')
  extras+=(--extra "ray==$ray")
fi
stoppable .venv/bin/tooling --no-progress bundle --wheel "$wheel" --out "$work/bundle" \
  --exclude-present ci/gpu/h200-image-packages.txt --extra dflash==0.1.0 \
  --extra GitPython==3.1.45 --extra gitdb==4.0.12 --extra smmap==5.0.2 \
  --extra flash-linear-attention==0.6.0 --extra fla-core==0.6.0 "${extras[@]}"
mkdir -p "$work/payload"
mv "$work"/bundle/vllm-*-bundle-* "$work/payload/bundle"
cp "$cache/pypi/vllm-0.20.1.tar.gz" "$work/payload/"
# Triton 3.7.1 beside the bundle, not in it: vLLM keeps the Triton its torch brings, while
# flash-linear-attention's gated backward refuses Hopper under Triton < 3.7.1. The hash pins
# the wheel's bytes.
if [ "${TRAINING:-1}" != 0 ]; then
  echo "triton==3.7.1 --hash=sha256:7e40869937a68206ec70d7f25bb7ec6433cb083f9135e1f36dbd318dc449a728" \
    > "$work/train-wheels.txt"
  stoppable .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps \
    --require-hashes --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 -r "$work/train-wheels.txt" -d "$work/payload/train-wheels"
fi
stoppable .venv/bin/python -m tooling.release.split "$work/payload" "$out" "$size"
ls -l "$out"
