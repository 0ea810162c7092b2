"""Patch 2 refuses what it does not compute, through vLLM 0.20.1's own model construction (slow).

In the probe interpreter with the patched (and the pristine) 0.20.1 tree
first on the path, the DFlash drafter is built the way the loader builds it,
from a drafter config.json carrying each key later releases honour. A key that
asks for other attention than patch 2 computes (the reference dflash 0.1.0:
sliding layers causal within the window, full layers bidirectional) is a
one-line start-up error naming the key and the drafter; a value that agrees is
accepted. Sliding layers on FlashAttention 4 (what vLLM's own version choice
picks on an sm100 device) are refused unless the opt-in is set.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from .helpers import run_on_tree

pytestmark = pytest.mark.slow

MIXED = ["sliding_attention", "sliding_attention", "full_attention"]
SLIDING = ["sliding_attention"] * 3
FULL = ["full_attention"] * 3
OPT_IN = "VLLM_DFLASH_ALLOW_UNVALIDATED_FA4_SWA"

# name: (layer_types, sliding_window, dflash_config additions, top-level additions)
CASES = {
    "plain": (MIXED, 16, {}, {}),
    "causal_all_layers": (MIXED, 16, {"causal": True}, {}),
    "causal_agrees_all_sliding": (SLIDING, 16, {"causal": True}, {}),
    "causal_false_agrees_all_full": (FULL, None, {"causal": False}, {}),
    "is_causal_false": (MIXED, 16, {}, {"is_causal": False}),
    "use_swa_on_full_layers": (FULL, None, {"use_swa": True}, {}),
    "use_swa_agrees_with_layer_types": (MIXED, 16, {"use_swa": True}, {}),
    "swa_window_size_differs": (MIXED, 16, {"swa_window_size": 8}, {}),
    "swa_window_size_agrees": (MIXED, 16, {"swa_window_size": 16}, {}),
    "attention_sink_bias": (MIXED, 16, {"attention_sink_bias": True}, {}),
    "attention_sink_bias_false": (MIXED, 16, {"attention_sink_bias": False}, {}),
    "add_swa_attention_sink_bias": (MIXED, 16, {}, {"add_swa_attention_sink_bias": True}),
}

REFUSED_KEY = {
    "causal_all_layers": "dflash_config.causal=True",
    "is_causal_false": "is_causal=False",
    "use_swa_on_full_layers": "dflash_config.use_swa=True",
    "swa_window_size_differs": "dflash_config.swa_window_size=8",
    "attention_sink_bias": "dflash_config.attention_sink_bias=True",
    "add_swa_attention_sink_bias": "add_swa_attention_sink_bias=True",
}

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, types
    from tooling.probes import _harness
    _harness.install_cpu_platform()
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    cases, out_path = json.loads(sys.argv[1]), sys.argv[2]

    def build(layer_types, window, dflash_extra, top_extra):
        pair = _harness.write_tiny_pair(
            _harness.scratch_dir(), target_layers=8, target_layer_ids=[1, 3, 5],
            layer_types=layer_types, sliding_window=window)
        path = pair.drafter / "config.json"
        cfg = json.loads(path.read_text())
        cfg["dflash_config"].update(dflash_extra)
        cfg.update(top_extra)
        path.write_text(json.dumps(cfg))
        config = _harness.vllm_config(pair)
        _harness.ensure_single_process_group(config)
        torch.set_default_dtype(torch.bfloat16)
        try:
            with set_current_vllm_config(config):
                model = DFlashQwen3Model(vllm_config=config, prefix="model")
        except Exception as e:
            return {"drafter": str(pair.drafter), "error": type(e).__name__, "message": str(e)}
        finally:
            torch.set_default_dtype(torch.float32)
        impls = [layer.self_attn.attn.impl for layer in model.layers]
        return {
            "drafter": str(pair.drafter),
            "windows": [list(i.sliding_window) for i in impls],
            "fa_versions": [i.vllm_flash_attn_version for i in impls],
        }

    out = {name: build(*case) for name, case in cases.items()}

    # FlashAttention 4 as vLLM picks it on a Blackwell (sm100) device: the
    # platform reports capability 10.0 and the FA4 kernels as available (the
    # CPU has none), and vLLM's own get_flash_attn_version decides.
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    type(current_platform).get_device_capability = classmethod(
        lambda cls, device_id=0: DeviceCapability(10, 0))
    interface = types.ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    interface.is_fa_version_supported = lambda version: version == 4
    interface.fa_version_unsupported_reason = lambda version: None
    package = types.ModuleType("vllm.vllm_flash_attn")
    package.flash_attn_interface = interface
    sys.modules["vllm.vllm_flash_attn"] = package
    sys.modules["vllm.vllm_flash_attn.flash_attn_interface"] = interface
    plain = cases["plain"]
    out["fa4"] = build(*plain)
    os.environ["VLLM_DFLASH_ALLOW_UNVALIDATED_FA4_SWA"] = "1"
    out["fa4_opted_in"] = build(*plain)
    json.dump(out, open(out_path, "w"))
    """
)


def _build_all(probe_python: Path, tree: Path, tmp: Path) -> dict:
    return run_on_tree(
        probe_python, tree, tmp, SCRIPT, json.dumps(CASES), timeout=600, unset=(OPT_IN,)
    )


@pytest.fixture(scope="session")
def patched(probe_python: Path, patched_0201, tmp_path_factory) -> dict:
    assert patched_0201.ok
    return _build_all(probe_python, Path(patched_0201.work_dir), tmp_path_factory.mktemp("patched"))


@pytest.fixture(scope="session")
def stock(probe_python: Path, upstream_0201, tmp_path_factory) -> dict:
    return _build_all(probe_python, upstream_0201.source_dir, tmp_path_factory.mktemp("stock"))


@pytest.mark.parametrize("case", sorted(REFUSED_KEY))
def test_disagreeing_key_is_refused_in_one_line_naming_key_and_drafter(patched, case) -> None:
    outcome = patched[case]
    assert outcome.get("error") == "ValueError", outcome
    message = outcome["message"]
    assert "\n" not in message
    assert REFUSED_KEY[case] in message
    assert outcome["drafter"] in message


@pytest.mark.parametrize("case", sorted(set(CASES) - set(REFUSED_KEY)))
def test_agreeing_value_is_accepted_with_the_reference_windows(patched, case) -> None:
    outcome = patched[case]
    assert "error" not in outcome, outcome
    layer_types = CASES[case][0]
    expected = [[15, 0] if t == "sliding_attention" else [-1, -1] for t in layer_types]
    assert outcome["windows"] == expected


def test_stock_0201_serves_those_drafters_silently_with_other_attention(stock) -> None:
    # What the refusals are for: stock vLLM builds every one, all full attention.
    for case in REFUSED_KEY:
        assert stock[case]["windows"] == [[-1, -1]] * 3, stock[case]


def test_fa4_sliding_window_is_refused_naming_the_opt_in(patched) -> None:
    outcome = patched["fa4"]
    assert outcome.get("error") == "ValueError", outcome
    assert OPT_IN + "=1" in outcome["message"]
    assert "FlashAttention 4" in outcome["message"]
    assert outcome["drafter"] in outcome["message"]


def test_fa4_sliding_window_runs_with_the_opt_in(patched) -> None:
    outcome = patched["fa4_opted_in"]
    assert "error" not in outcome, outcome
    assert outcome["fa_versions"] == [4, 4, 4]
    assert outcome["windows"] == [[15, 0], [15, 0], [-1, -1]]
