"""The session step ``kernels`` holds patches 36 and 37 to what they replace on the GPU; here
its checks run on the CPU, in Triton's interpreter on the patched tree, to show they pass the
kernels as written and catch each control fault. vLLM's CUDA kernels do not run on the CPU:
its RMSNorm and RoPE are the probe's torch versions of them, its cache insert the loop below.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_on_tree

pytestmark = pytest.mark.slow

CHECKS = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from vllm import _custom_ops as ops
from tooling.host import kernel_context as kc, kernel_correction as kcor
from tooling.probes.context_kv_one_launch import _reference_rms, _reference_rope

def insert(key, value, key_cache, value_cache, slots, cache_dtype, k_scale, v_scale):
    block = key_cache.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for cache, x, scale in ((key_cache, key[t], k_scale), (value_cache, value[t], v_scale)):
            if cache_dtype == "fp8":
                x = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
            cache[slot // block, slot % block] = x

ops.rms_norm = _reference_rms
ops.rotary_embedding = _reference_rope
ops.reshape_and_cache_flash = insert
# The interpreter's host time says nothing of a GPU's; each check still calls its paths once.
kc.host_us = kcor.host_us = lambda call, repeats=1: 0.0

cpu = torch.device("cpu")
cases = [
    kc.Case("float16", 2, 2, 16, 16, True, "float16", "auto", 9, 4),
    kc.Case("fp8 gpt-j partial", 2, 2, 16, 8, False, "float16", "fp8", 9, 4),
]
out = {"context": {}, "correction": {}}
for case in cases:
    for control in (None, *kc.CONTROLS):
        o = kc.run_case(case, cpu, control)
        out["context"][f"{case.name}/{control}"] = [o.ok, o.worst_steps, o.stray_rows]
for control in (False, True):
    c = kcor.run_change(kcor.CHANGES[2], cpu, control)
    out["correction"][str(control)] = [c.ok, c.computed_differ, c.accepted_differ]
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def checked(probe_python, patched_0201, tmp_path_factory) -> dict:
    assert patched_0201.ok
    tmp = tmp_path_factory.mktemp("kernel-checks")
    return run_on_tree(probe_python, Path(patched_0201.work_dir), tmp, CHECKS, "", timeout=900)


def test_the_context_check_passes_the_kernel_and_catches_each_fault(checked):
    context = checked["context"]
    # float16 is rounded by the interpreter as on the GPU: the kernel is within the bound.
    assert context["float16/None"][0] is True
    assert context["float16/None"][2] == 0
    for case in ("float16", "fp8 gpt-j partial"):
        for control in ("sine negated", "positions one later"):
            ok, worst, _ = context[f"{case}/{control}"]
            assert ok is False, (case, control, worst)
            assert worst > 5


def test_the_correction_check_passes_the_kernel_and_catches_its_fault(checked):
    correction = checked["correction"]
    assert correction["False"] == [True, 0, 0]
    ok, computed, accepted = correction["True"]
    assert ok is False and computed > 0 and accepted > 0
