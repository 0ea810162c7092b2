# shellcheck shell=bash
# Shared locations on the GPU host (sourced by the other scripts).
export WORK=${WORK:-/tmp/dflash}
export SITE=$WORK/site              # vLLM's dependencies (bundle, pip --target)
export ENGINES=$WORK/engines        # one vLLM install per engine variant
export VLLM_DFLASH_CACHE=$WORK/cache
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1795910400}
# NVLink multicast stays off (the host's GPUs are shared; a program using it can take them
# out of service): NCCL, PyTorch and NVSHMEM, for every child too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
