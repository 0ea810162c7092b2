"""Let a release's code that branches on a CUDA device run its CUDA branch on the CPU.

Some of vLLM's code decides what it does by the device it is given: 0.34.0's Gated
DeltaNet metadata builder shares one group's build with the next only where
``device.type`` is ``cuda`` or ``xpu``. On a machine without a GPU a probe handing it
the CPU asks a question users never meet. Inside :func:`cuda_on_cpu` the code under
test is handed ``torch.device("cuda")`` and keeps it, and every tensor it asks for on
that device is made on the CPU instead, so its CUDA branch runs with real tensors.
Only placement changes: the operations, their order and their values are the release's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _is_cuda(value: Any) -> bool:
    import torch

    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.split(":")[0] == "cuda"


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[Any]:
    """Yield ``torch.device("cuda")``; within, tensors placed on it land on the CPU."""
    import torch
    from torch.overrides import TorchFunctionMode

    class _CudaOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = {
                k: "cpu" if k == "device" and _is_cuda(v) else v for k, v in (kwargs or {}).items()
            }
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to:
                args = tuple("cpu" if _is_cuda(a) else a for a in args)
            return func(*args, **kwargs)

    with _CudaOnCpu():
        yield torch.device("cuda")
