"""Patch 37: the DFlash drafter's context K/V normed, rotated and cached in one Triton launch.

The kernel runs in Triton's interpreter on the CPU, on the patched tree, against the K/V
that vLLM's three kernels write (RMSNorm, RoPE, the cache insert), computed here in torch
with their rounding. The interpreter rounds float32 to float16 as the GPU does, so float16
must match to the bit; it truncates to bfloat16 and misrounds some float8 values, so
bfloat16 is held to a few of its steps and float8 to the interpreter's own conversion of
the expected value.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import REPO_DIR, run_on_tree

pytestmark = pytest.mark.slow

KERNEL = textwrap.dedent(
    """
    import json, os, sys, types
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton
    import triton.language as tl
    from tooling.probes.context_kv_one_launch import _reference_rms, _reference_rope
    from vllm.model_executor.models.dflash_context_kv import ContextKVWriter, why_not_fused

    @triton.jit
    def _fp8(x_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(x_ptr + offs)
        tl.store(out_ptr + offs, x.to(tl.float8e4nv).to(tl.uint8, bitcast=True))

    def as_triton_fp8(x):
        flat = x.float().flatten().contiguous()
        n = triton.next_power_of_2(flat.numel())
        padded = torch.zeros(n)
        padded[: flat.numel()] = flat
        out = torch.zeros(n, dtype=torch.uint8)
        _fp8[(1,)](padded, out, N=n)
        return out[: flat.numel()].view(x.shape)

    def case(layers, nkv, hd, rot, neox, dtype, fp8, n=11, block=4, blocks=9):
        g = torch.Generator().manual_seed(layers * 100 + hd)
        all_kv = (torch.randn(n, layers * 2 * nkv * hd, generator=g) * 3).to(dtype)
        weights = [torch.randn(hd, generator=g).to(dtype) for _ in range(layers)]
        cos_sin = torch.randn(64, rot, generator=g).to(dtype)
        positions = torch.randint(0, 64, (n,), generator=g)
        slots = torch.randperm(blocks * block, generator=g)[:n]
        slots[3] = -1
        cache_dtype = torch.uint8 if fp8 else dtype
        attn = [
            types.SimpleNamespace(
                kv_cache=torch.zeros(2, blocks, block, nkv, hd, dtype=cache_dtype),
                _k_scale=torch.tensor([0.5 + i]),
                _v_scale=torch.tensor([1.5]),
                kv_cache_dtype="fp8" if fp8 else "auto",
            )
            for i in range(layers)
        ]
        ContextKVWriter(attn, weights, 1e-6, nkv, hd, neox).write(
            all_kv, positions, slots, cos_sin
        )
        view = all_kv.view(n, layers, 2, nkv, hd)
        worst, rows = 0.0, 0
        for i, a in enumerate(attn):
            k = torch.empty_like(view[:, i, 0])
            _reference_rms(k, view[:, i, 0], weights[i], 1e-6)
            flat = k.reshape(n, -1)
            _reference_rope(positions, flat, None, hd, cos_sin, neox)
            k = flat.view(n, nkv, hd)
            v = view[:, i, 1]
            written = a.kv_cache.reshape(2, -1, nkv, hd).abs().sum((0, 2, 3)) > 0
            rows += int(written.sum())
            for t, slot in enumerate(slots.tolist()):
                if slot < 0:
                    continue
                got = a.kv_cache[:, slot // block, slot % block]
                for want, have, scale in ((k[t], got[0], a._k_scale), (v[t], got[1], a._v_scale)):
                    if fp8:
                        clamped = (want.float() / scale).clamp(-448, 448)
                        worst = max(worst, float((have != as_triton_fp8(clamped)).sum()))
                    else:
                        # In steps of the largest value's last bit in this dtype.
                        step = want.float().abs().max() * torch.finfo(dtype).eps
                        error = (have.float() - want.float()).abs().max() / step
                        worst = max(worst, float(error))
        return {"worst": worst, "rows": rows, "expected_rows": layers * (n - 1)}

    out = {}
    for name, c in json.loads(sys.argv[1]).items():
        dtype = getattr(torch, c.pop("dtype"))
        out[name] = case(dtype=dtype, **c)

    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
    impl = FlashAttentionImpl.__new__(FlashAttentionImpl)
    def layer(**kw):
        base = dict(impl=impl, kv_cache=torch.zeros(2, 4, 4, 2, 8, dtype=torch.bfloat16),
                    kv_cache_dtype="auto")
        base.update(kw)
        return types.SimpleNamespace(**base)
    out["why_not"] = {
        "served": why_not_fused([layer(), layer()], torch.bfloat16),
        "e5m2": why_not_fused([layer(kv_cache_dtype="fp8_e5m2")], torch.bfloat16),
        "layouts": why_not_fused(
            [layer(), layer(kv_cache=torch.zeros(2, 5, 4, 2, 8, dtype=torch.bfloat16))],
            torch.bfloat16,
        ),
        "other backend": why_not_fused([layer(impl=object())], torch.bfloat16),
        "dtype": why_not_fused([layer()], torch.float16),
    }
    json.dump(out, open(sys.argv[2], "w"))
    """
)


CASES = {
    # The seed's drafter: NeoX RoPE over the whole head, 8 KV heads of 128 (here 2 of 16).
    "neox": dict(layers=3, nkv=2, hd=16, rot=16, neox=True, fp8=False, dtype="float16"),
    "gpt-j": dict(layers=3, nkv=2, hd=16, rot=16, neox=False, fp8=False, dtype="float16"),
    "partial rotary": dict(layers=2, nkv=2, hd=16, rot=8, neox=True, fp8=False, dtype="float16"),
    "odd sizes": dict(layers=5, nkv=3, hd=24, rot=24, neox=True, fp8=False, dtype="float16"),
    "bfloat16": dict(layers=3, nkv=2, hd=16, rot=16, neox=True, fp8=False, dtype="bfloat16"),
    "fp8": dict(layers=3, nkv=2, hd=16, rot=16, neox=True, fp8=True, dtype="float16"),
    "fp8 gpt-j partial": dict(
        layers=2, nkv=3, hd=24, rot=12, neox=False, fp8=True, dtype="float16"
    ),
}


@pytest.fixture(scope="module")
def written(probe_python, patched_0201, tmp_path_factory) -> dict:
    assert patched_0201.ok
    tmp = tmp_path_factory.mktemp("context-kv")
    tree = Path(patched_0201.work_dir)
    return run_on_tree(probe_python, tree, tmp, KERNEL, json.dumps(CASES), timeout=600)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n]["dtype"] == "float16"])
def test_the_kernel_writes_vllms_k_and_v_to_the_bit(written, name):
    """float16 (rounded by the interpreter as on the GPU): every row as vLLM's kernels write
    it, nothing for the padding slot; float8 as Triton converts the expected value."""
    found = written[name]
    assert found["worst"] == 0, found
    assert found["rows"] == found["expected_rows"]


def test_bfloat16_is_within_the_interpreters_truncation(written):
    """The interpreter truncates float32 to bfloat16 where the GPU rounds: each of the
    kernel's roundings may then be a step off, never more than a few in all."""
    found = written["bfloat16"]
    assert 0 < found["worst"] <= 4, found
    assert found["rows"] == found["expected_rows"]


def test_caches_the_kernel_cannot_write_keep_vllms_kernels_with_a_reason(written):
    why = written["why_not"]
    assert why["served"] is None
    assert "fp8_e5m2" in why["e5m2"]
    assert "differ in shape or layout" in why["layouts"]
    assert "not FlashAttention" in why["other backend"]
    assert "torch.bfloat16" in why["dtype"] and "torch.float16" in why["dtype"]


def _shadow(tree: Path, into: Path, broken: Path) -> Path:
    """``tree`` seen through links, but for ``broken``'s file, which is copied and edited."""
    here, there = tree, into
    for part in broken.relative_to(tree).parts:
        there.mkdir(parents=True, exist_ok=True)
        for entry in here.iterdir():
            if entry.name != part:
                (there / entry.name).symlink_to(entry)
        here, there = here / part, there / part
    shutil.copy(broken, there)
    return into


def test_the_probe_reads_unknown_where_the_kernel_rotates_wrong(
    probe_python, patched_0201, tmp_path
):
    """A kernel that adds where RoPE subtracts writes K the stock path would not: the probe
    can tell, and says unknown, not present."""
    tree = Path(patched_0201.work_dir)
    module = tree / "vllm/model_executor/models/dflash_context_kv.py"
    shadow = _shadow(tree, tmp_path / "tree", module)
    copy = shadow / module.relative_to(tree)
    text = copy.read_text()
    rotation = "(x * cos).to(OUT).to(tl.float32) - (y * sin)"
    assert text.count(rotation) == 1
    copy.write_text(text.replace(rotation, rotation.replace(" - ", " + ")))
    args = ("probe", "--root", str(shadow), "--python", str(probe_python))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tooling",
            "--cache-dir",
            str(tmp_path / "cache"),
            *args,
            "--probe",
            "context_kv_one_launch",
            "--json",
        ],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "TOOLING_NO_PROBE_CACHE": "1"},
    )
    assert done.returncode == 12, done.stdout + done.stderr
    (result,) = json.loads(done.stdout)["results"]
    assert result["status"] == "unknown"
    assert "K differs" in result["evidence"] and "V differs" not in result["evidence"]
