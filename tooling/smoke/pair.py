"""What the smoke must know of a model pair to plan for it, read without loading it.

From each model's ``config.json`` and the sizes its safetensors declare (the
index's ``total_size``, or each file's header): the weights' bytes, the
KV-cache bytes an engine needs per token and per sequence, and whether the
pair is one the smoke can serve at all. Nothing here writes: a user's model
folders are only read.

For ``--tiny`` the pair does not exist yet when the run is planned (it is
generated while the preflight runs), so its figures come from the configs the
generator writes (``serving.tiny`` builds them) and a parameter count of those shapes.

This is the one module that reads a model's ``config.json`` (``find_model_file``): the plan
and the runner take what it read, and ``config`` only interprets contents it is handed
(``drafter_info_from_config``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SmokeError, SmokePairError
from ..schema import Doc
from .config import DrafterInfo, drafter_info_from_config
from .pair_schema import block_size, check_figures, check_pair, safetensors_bytes

#: Architecture name endings vLLM serves as a causal LM (a multimodal one with
#: ``--language-model-only``).
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
#: vLLM keeps a Gated DeltaNet layer's recurrent state in float32 unless told otherwise.
RECURRENT_STATE_BYTES = 4
GIB = 2**30


@dataclass(frozen=True)
class ModelFacts:
    """One model's figures for planning."""

    path: str
    architectures: tuple[str, ...]
    weight_bytes: int
    """What its safetensors declare (or, for a model not yet written, its parameter count
    times the dtype's size)."""
    attention_layers: int
    """Layers with a KV cache that grows with the context."""
    kv_bytes_per_token: int
    """Key and value of every such layer, per token, in the model's dtype."""
    recurrent_layers: int = 0
    recurrent_state_bytes: int = 0
    """A linear-attention (Gated DeltaNet) layer's state per sequence: fixed, not per token."""
    vocab_size: int = 0
    multimodal: bool = False
    """A vision tower beside the language model (served with ``--language-model-only``)."""
    block_size: int | None = None
    """A DFlash drafter's block, as its config states it: the step's last token and the
    masks it drafts, so K is at most ``block_size - 1``."""

    @property
    def hybrid(self) -> bool:
        return self.recurrent_layers > 0


@dataclass(frozen=True)
class PairFacts:
    target: ModelFacts
    drafter: ModelFacts

    def to_json(self) -> dict[str, Any]:
        return {
            "target_gib": round(self.target.weight_bytes / GIB, 2),
            "drafter_gib": round(self.drafter.weight_bytes / GIB, 2),
            "target_hybrid": self.target.hybrid,
            "vocab_size": self.target.vocab_size,
        }


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a (possibly multimodal) config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _dtype_bytes(config: dict[str, Any]) -> int:
    text = text_config(config)
    name = text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16"
    return DTYPE_BYTES.get(str(name), 2)


def _layer_types(text: dict[str, Any]) -> list[str]:
    layers = int(text.get("num_hidden_layers", 0))
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        return [str(t) for t in types]
    return ["full_attention"] * layers


def _head_dim(text: dict[str, Any]) -> int:
    heads = int(text.get("num_attention_heads", 1))
    return int(text.get("head_dim") or int(text.get("hidden_size", 0)) // heads)


def _recurrent_state_bytes(text: dict[str, Any]) -> int:
    """One Gated DeltaNet layer's state per sequence: the delta-rule matrix and the conv window."""
    key_heads = int(text.get("linear_num_key_heads", 0))
    value_heads = int(text.get("linear_num_value_heads", 0))
    key_dim = int(text.get("linear_key_head_dim", 0))
    value_dim = int(text.get("linear_value_head_dim", 0))
    kernel = int(text.get("linear_conv_kernel_dim", 4))
    conv_channels = 2 * key_heads * key_dim + value_heads * value_dim
    ssm = value_heads * key_dim * value_dim * RECURRENT_STATE_BYTES
    return ssm + conv_channels * (kernel - 1) * 2


def parameter_count(config: dict[str, Any], *, drafter: bool = False) -> int:
    """Parameters of a Qwen3 / Qwen3.5-family language model, or of a DFlash drafter
    (Qwen3 layers and the fc over the target's features; it uses the target's embeddings)."""
    text = text_config(config)
    hidden = int(text["hidden_size"])
    ffn = int(text["intermediate_size"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads", heads))
    head_dim = _head_dim(text)
    vocab = int(text.get("vocab_size", 0))
    gated = text.get("linear_num_key_heads") is not None  # Qwen3.5: q_proj carries the gate
    attention = (
        hidden * heads * head_dim * (2 if gated else 1)
        + 2 * hidden * kv_heads * head_dim
        + heads * head_dim * hidden
        + 2 * head_dim
    )
    key = int(text.get("linear_num_key_heads", 0)) * int(text.get("linear_key_head_dim", 0))
    value_heads = int(text.get("linear_num_value_heads", 0))
    value = value_heads * int(text.get("linear_value_head_dim", 0))
    kernel = int(text.get("linear_conv_kernel_dim", 4))
    linear = (
        hidden * (2 * key + 2 * value)
        + hidden * 2 * value_heads
        + (2 * key + value) * kernel
        + 2 * value_heads
        + int(text.get("linear_value_head_dim", 0))
        + value * hidden
    )
    total = 0
    for layer_type in _layer_types(text):
        mixer = linear if layer_type == "linear_attention" else attention
        total += mixer + 3 * hidden * ffn + 2 * hidden
    total += hidden
    if drafter:
        ids = (config.get("dflash_config") or {}).get("target_layer_ids") or ()
        total += len(ids) * hidden * hidden + hidden
    else:
        tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
        total += vocab * hidden * (1 if tied else 2)
    return total


def facts_from_config(
    path: str, config: dict[str, Any], weight_bytes: int | None, *, drafter: bool = False
) -> ModelFacts:
    """A model's figures from its config; ``weight_bytes`` None: counted from the shapes."""
    text = text_config(config)
    types = _layer_types(text)
    linear = sum(1 for t in types if t == "linear_attention")
    attention = len(types) - linear
    per_layer = 2 * int(text.get("num_key_value_heads", text.get("num_attention_heads", 1)))
    per_layer *= _head_dim(text) * _dtype_bytes(config)
    if weight_bytes is None:
        weight_bytes = parameter_count(config, drafter=drafter) * _dtype_bytes(config)
    return ModelFacts(
        path=path,
        architectures=tuple(str(a) for a in config.get("architectures") or ()),
        weight_bytes=weight_bytes,
        attention_layers=attention,
        kv_bytes_per_token=attention * per_layer,
        recurrent_layers=linear,
        recurrent_state_bytes=_recurrent_state_bytes(text) if linear else 0,
        vocab_size=int(text.get("vocab_size", 0)),
        multimodal="vision_config" in config,
        block_size=_block_size(config) if drafter else None,
    )


def _block_size(config: dict[str, Any]) -> int | None:
    """A drafter's block size: z-lab's drafters state it at the top level, the reference
    package's ``dflash_config`` too (checked: ``pair_schema.block_size``)."""
    return block_size(config, Doc("the drafter's config", SmokePairError))


def refusal(target: dict[str, Any], drafter: dict[str, Any], names: tuple[str, str]) -> str | None:
    """Why the smoke cannot serve this pair, in one line naming the figure (pure)."""
    archs = target.get("architectures") or []
    if not any(str(a).endswith(CAUSAL_LM_SUFFIXES) for a in archs):
        return (
            f"{names[0]}: the target's architectures {archs} name no causal LM "
            f"(an architecture ending in {' or '.join(CAUSAL_LM_SUFFIXES)})"
        )
    dflash = drafter.get("dflash_config")
    if not isinstance(dflash, dict):
        return f"{names[1]}: the drafter has no dflash_config: not a DFlash drafter"
    if not dflash.get("target_layer_ids"):
        return f"{names[1]}: the drafter's dflash_config has no target_layer_ids"
    return None


def weight_bytes(model: str) -> int:
    """The bytes of ``model``'s weights: the index's ``total_size``, else the headers of its
    safetensors (a local folder, or a hub model in the local HF cache)."""
    try:
        index = find_model_file(model, "model.safetensors.index.json")
    except SmokeError:
        index = None
    try:
        if index is not None:
            doc = Doc(str(index), SmokePairError)
            data = json.loads(index.read_text(encoding="utf-8"))
            metadata = doc.table(data, "metadata", {})
            total = doc.inner(": metadata").whole(metadata, "total_size", None, least=0)
            if total:
                return int(total)
            weight_map = doc.table(data, "weight_map")
            names = sorted({doc.inner(": weight_map").text(weight_map, k) for k in weight_map})
            if any(Path(n).name != n for n in names):
                doc.fail(f"weight_map names a file outside {index.parent}")
            return sum(safetensors_bytes(index.parent / n) for n in names)
        local = Path(model)
        files = sorted(local.glob("*.safetensors")) if local.is_dir() else []
        if not files:
            files = [find_model_file(model, "model.safetensors")]
        return sum(safetensors_bytes(f) for f in files)
    except SmokePairError:
        raise  # a file there, and not what it should be: named by the check
    except SmokeError:
        raise SmokePairError(f"{model}: no safetensors weights to size the model by") from None
    except (OSError, ValueError) as e:
        raise SmokePairError(f"{model}: cannot read its safetensors sizes: {e}") from None


def find_model_file(model: str, filename: str) -> Path:
    """``filename`` of a local model folder, or of a hub model already in the local HF cache."""
    local = Path(model)
    if local.is_dir():
        path = local / filename
        if not path.is_file():
            raise SmokeError(f"{local}: no {filename}")
        return path
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        raise SmokeError(
            f"{model}: not a folder, and huggingface_hub is not importable to look in the HF cache"
        ) from None
    cached = try_to_load_from_cache(model, filename)
    if not isinstance(cached, str):
        raise SmokeError(
            f"{model}: not a folder and its {filename} is not in the local HF cache "
            "(the smoke runs offline: download the model first)"
        )
    return Path(cached)


def _read_config(model: str, role: str) -> dict[str, Any]:
    """``model``'s config.json (local folder or HF cache); ``role`` names it in errors."""
    path = find_model_file(model, "config.json")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SmokeError(f"{path}: cannot read the {role} config: {e}") from None


def read_drafter_info(drafter: str) -> DrafterInfo:
    """Read the drafter's config.json (local folder or HF cache) into DrafterInfo."""
    return drafter_info_from_config(_read_config(drafter, "drafter"))


def _config(model: str, role: str) -> tuple[Path, dict[str, Any]]:
    try:
        path = find_model_file(model, "config.json")
    except SmokeError as e:
        raise SmokePairError(f"the {role}: {e}") from None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SmokePairError(f"{path}: cannot read the {role} config: {e}") from None
    if not isinstance(data, dict):
        raise SmokePairError(f"{path}: the {role} config is not a JSON object")
    return path, data


def read_pair(target: str, drafter: str) -> PairFacts:
    """The pair's figures from its folders (or the HF cache); SmokePairError, one line,
    when it is not a pair the smoke can serve (every figure checked first, naming the file
    and the key: ``pair_schema``)."""
    (target_path, target_config), (drafter_path, drafter_config) = (
        _config(target, "target"),
        _config(drafter, "drafter"),
    )
    target_doc = Doc(str(target_path), SmokePairError)
    drafter_doc = Doc(str(drafter_path), SmokePairError)
    check_figures(target_config, target_doc)
    check_figures(drafter_config, drafter_doc)
    why = refusal(target_config, drafter_config, (target, drafter))
    if why:
        raise SmokePairError(why)
    check_pair(target_config, drafter_config, target_doc, drafter_doc)
    return PairFacts(
        target=facts_from_config(target, target_config, weight_bytes(target)),
        drafter=facts_from_config(drafter, drafter_config, weight_bytes(drafter), drafter=True),
    )


def tiny_pair(arch: str, hidden_size: int | None, root: Path) -> PairFacts:
    """The figures of the ``--tiny`` pair the run will generate under ``root``."""
    from .serving.tiny import TinySpec, drafter_config, target_config

    spec = TinySpec.for_arch(arch, hidden_size=hidden_size)
    return PairFacts(
        target=facts_from_config(str(root / "target"), target_config(spec), None),
        drafter=facts_from_config(str(root / "drafter"), drafter_config(spec), None, drafter=True),
    )
