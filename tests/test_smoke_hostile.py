"""``tooling smoke --dry-run`` on a user's pair under hostile or careless input: every figure
the plan reads is checked (the configs' values, what a drafter needs of its target, the
safetensors headers), and --gpus is bounded before a plan is made for it. Each refusal is
one line naming the file and the key, and plans nothing."""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import SmokeError, SmokePairError
from tooling.smoke.serving.tiny import TinySpec, drafter_config, target_config

from .smoke_models import write_model


def _set(config: dict[str, Any], key: str, value: Any) -> None:
    """``key`` (dotted for a nested table) set to ``value``; ``...`` removes it."""
    *tables, last = key.split(".")
    for table in tables:
        config = config[table]
    if value is ...:
        del config[last]
    else:
        config[last] = value


def _pair(tmp_path: Path, target: dict[str, Any] | None = None, **drafter: Any) -> Path:
    """The tiny attention-only pair (an 8-layer target of width 256; a drafter reading its
    layers 1, 3 and 5 in blocks of 4) as a user's folders, with ``target`` and ``drafter``
    values set (``__`` for a dot in a key)."""
    spec = TinySpec.for_arch("qwen3")
    configs = {"target": target_config(spec), "drafter": drafter_config(spec)}
    for key, value in (target or {}).items():
        _set(configs["target"], key, value)
    for key, value in drafter.items():
        _set(configs["drafter"], key.replace("__", "."), value)
    for role, config in configs.items():
        write_model(tmp_path / "pair" / role, copy.deepcopy(config), 10**6)
    return tmp_path / "pair"


def _plan(tmp_path: Path, pair: Path, *args: str, gpus: str = "1x141") -> Any:
    command = ["smoke", "--dry-run", "--gpus", gpus, "--workdir", str(tmp_path / "w")]
    command += ["--target", str(pair / "target"), "--drafter", str(pair / "drafter"), *args]
    return CliRunner().invoke(main, command)


def test_the_pair_as_written_plans(tmp_path: Path) -> None:
    result = _plan(tmp_path, _pair(tmp_path))
    assert result.exit_code == 0, result.stderr


def _refused(result: Any, file: Path, why: str) -> None:
    assert result.exit_code == SmokePairError.exit_code, result.output
    assert result.stderr.startswith(f"error: {file}: {why}"), result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""


def test_a_drafter_reading_a_layer_the_target_lacks_is_refused(tmp_path: Path) -> None:
    """[1, 3, 99] on an 8-layer target was planned for."""
    pair = _pair(tmp_path, dflash_config__target_layer_ids=[1, 3, 99])
    _refused(
        _plan(tmp_path, pair),
        pair / "drafter" / "config.json",
        "dflash_config: target_layer_ids [1, 3, 99]: 99 is no layer the target's 8 give the "
        "drafter (0 to 6)",
    )


@pytest.mark.parametrize(
    ("value", "why"),
    [(0, "block_size 0 is below 2"), ("4", "block_size '4' is not a whole number")],
)
def test_a_drafter_block_that_is_not_a_block_is_refused(
    tmp_path: Path, value: Any, why: str
) -> None:
    """0 was taken for no block size, "4" too, and K then went unchecked: K = 15 on a
    block of 4 was planned for."""
    pair = _pair(tmp_path, block_size=value)
    result = _plan(tmp_path, pair, "--num-speculative-tokens", "15")
    _refused(result, pair / "drafter" / "config.json", why)


def test_a_drafter_of_another_width_than_its_target_is_refused(tmp_path: Path) -> None:
    pair = _pair(tmp_path, hidden_size=512)
    _refused(
        _plan(tmp_path, pair),
        pair / "drafter" / "config.json",
        "hidden_size 512 is not the target's 256: a DFlash drafter reads the target's hidden "
        "states and embeddings at the target's width",
    )


#: A value of each figure the plan reads, of the wrong type or out of range.
MALFORMED_TARGET = [
    ("num_hidden_layers", "8", "num_hidden_layers '8' is not a whole number"),
    ("num_hidden_layers", 0, "num_hidden_layers 0 is below 1"),
    ("num_hidden_layers", ..., "missing key 'num_hidden_layers'"),
    ("hidden_size", 256.0, "hidden_size 256.0 is not a whole number"),
    ("hidden_size", 10**12, "hidden_size 1000000000000 is above 1048576"),
    ("num_attention_heads", True, "num_attention_heads True is not a whole number"),
    ("num_key_value_heads", 8, "num_key_value_heads 8 is above 4"),
    ("head_dim", "64", "head_dim '64' is not a whole number"),
    ("vocab_size", 1e30, "vocab_size 1e+30 is not a whole number"),
    ("layer_types", "full_attention", "layer_types 'full_attention' is not a list of strings"),
    ("layer_types", ["full_attention"] * 3, "layer_types names 3 layers, num_hidden_layers 8"),
    ("architectures", "Qwen3ForCausalLM", "architectures 'Qwen3ForCausalLM' is not a list of "),
    ("tie_word_embeddings", "no", "tie_word_embeddings 'no' is not true or false"),
    ("torch_dtype", 2, "torch_dtype 2 is not a string"),
    ("linear_conv_kernel_dim", -1, "linear_conv_kernel_dim -1 is below 1"),
]


@pytest.mark.parametrize(("key", "value", "why"), MALFORMED_TARGET)
def test_a_malformed_target_figure_is_one_line_naming_file_and_key(
    tmp_path: Path, key: str, value: Any, why: str
) -> None:
    pair = _pair(tmp_path, {key: value})
    _refused(_plan(tmp_path, pair), pair / "target" / "config.json", why)


MALFORMED_DRAFTER = [
    ("dflash_config__target_layer_ids", "1,3,5", "dflash_config: target_layer_ids '1,3,5' "),
    ("dflash_config__target_layer_ids", [1.0, 3], "dflash_config: target_layer_ids [1.0, 3] "),
    ("dflash_config__target_layer_ids", [-1, 3], "dflash_config: target_layer_ids [-1, 3]: -1 "),
    ("dflash_config__block_size", True, "dflash_config: block_size True is not a whole "),
    ("block_size", 10**9, "block_size 1000000000 is above 10000"),
    ("num_hidden_layers", [3], "num_hidden_layers [3] is not a whole number"),
]


@pytest.mark.parametrize(("key", "value", "why"), MALFORMED_DRAFTER)
def test_a_malformed_drafter_figure_is_one_line_naming_file_and_key(
    tmp_path: Path, key: str, value: Any, why: str
) -> None:
    extra = {"block_size": ...} if key.startswith("dflash_config__block") else {}
    pair = _pair(tmp_path, **{**extra, key: value})
    _refused(_plan(tmp_path, pair), pair / "drafter" / "config.json", why)


def _header(folder: Path, length: int, body: bytes = b"") -> Path:
    path = folder / "model-00000-of-00001.safetensors"
    path.write_bytes(struct.pack("<Q", length) + body)
    return path


@pytest.mark.parametrize(
    ("length", "body", "why"),
    [
        (2**64 - 1, b"{}", "its header claims 18446744073709551615 bytes, past the file's 10 "),
        (10**12, b"{}", "its header claims 1000000000000 bytes, past the file's 10 "),
        (2, b"[]", "is [], not a table of keys"),
        (5, b"{nope", "its header is not JSON ("),
        (None, b'{"w": {"data_offsets": 7}}', "w: data_offsets 7 is not a list of whole "),
        (None, b'{"w": {"data_offsets": [9, 1]}}', "w: data_offsets [9, 1] is not [begin, end]"),
        (10, b'{"w": "x"}' + b"\0" * 100, "w: is 'x', not a table of keys"),
    ],
)
def test_a_safetensors_header_that_is_not_one_is_refused_before_it_is_read(
    tmp_path: Path, length: int | None, body: bytes, why: str
) -> None:
    """A length of 2^64 - 1 or 10^12 was read as such: an OverflowError or a MemoryError."""
    pair = _pair(tmp_path)
    weights = _header(pair / "target", len(body) if length is None else length, body)
    _refused(_plan(tmp_path, pair), weights, why)


@pytest.mark.parametrize(
    ("gpus", "why"),
    [
        ("2xinf", "expected COUNTxGIB, e.g. 2x141"),
        ("2x1e400", "expected COUNTxGIB, e.g. 2x141"),
        ("2xnan", "expected COUNTxGIB, e.g. 2x141"),
        ("99999999999999999999x80", "expected COUNTxGIB, e.g. 2x141"),
        ("999999x80", "COUNT must be 1 to 64 (one host's GPUs)"),
        ("0x80", "COUNT must be 1 to 64 (one host's GPUs)"),
        ("1x0", "GIB must be above 0 and at most 4096"),
        ("1x9999999", "GIB must be above 0 and at most 4096"),
        ("-1x80", "expected COUNTxGIB, e.g. 2x141"),
    ],
)
def test_gpus_are_bounded_before_a_plan_is_made_for_them(
    tmp_path: Path, gpus: str, why: str
) -> None:
    """2xinf was an OverflowError; 99999999999999999999x80 grew past 1.2 GB and never
    answered."""
    result = _plan(tmp_path, _pair(tmp_path), gpus=gpus)
    assert (result.exit_code, result.stderr) == (
        SmokeError.exit_code,
        f"error: --gpus {gpus!r}: {why}\n",
    )


def test_a_workdir_that_is_a_file_is_a_usage_error(tmp_path: Path) -> None:
    """It was an unexpected FileExistsError."""
    mine = tmp_path / "notes.txt"
    mine.write_text("keep")
    command = ["smoke", "--tiny", "--workdir", str(mine), "--dry-run", "--gpus", "1x80"]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 2
    assert f"Invalid value for '--workdir': Directory '{mine}' is a file." in result.stderr
    assert mine.read_text() == "keep"


def test_a_weight_index_that_is_not_one_is_named(tmp_path: Path) -> None:
    pair = _pair(tmp_path)
    index = pair / "target" / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": "55GB"}, "weight_map": {}}))
    _refused(_plan(tmp_path, pair), index, "metadata: total_size '55GB' is not a whole number")
    index.write_text(json.dumps({"weight_map": {"w": "../../etc/x.safetensors"}}))
    _refused(_plan(tmp_path, pair), index, "weight_map names a file outside ")
