# shellcheck shell=bash
# Shared locations on the GPU host (sourced by the other scripts).
export WORK=${WORK:-/tmp/dflash}
export SITE=$WORK/site              # vLLM's dependencies (bundle, pip --target)
export ENGINES=$WORK/engines        # one vLLM install per engine variant
export VLLM_DFLASH_CACHE=$WORK/cache
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1795910400}
