"""A user's model pair read with every figure the plan uses checked first: each value of its
``config.json`` files for its type and range, the pair for what a DFlash drafter needs of
its target, and each safetensors header for its length and shape, before any of it is used.

A value of the wrong type or out of range was read as something else (``block_size: "4"``
as no block size, so K went unchecked), planned for (a drafter reading layer 99 of an
8-layer target), or ended in a traceback (a header claiming 2^64 - 1 bytes). Each is now a
SmokePairError (exit 23), one line naming the file and the key.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from ..errors import SmokePairError
from ..schema import Doc

#: The longest safetensors header read: the format's own limit (the ``safetensors`` library
#: refuses longer ones).
HEADER_LIMIT = 100_000_000
#: Bounds past any model vLLM serves, so a figure cannot make the plan's arithmetic run away.
MAX_LAYERS = 10_000
MAX_WIDTH = 1 << 20
MAX_VOCAB = 1 << 24


def text_part(config: Any, doc: Doc) -> tuple[dict[str, Any], Doc]:
    """The language model's part of a (possibly multimodal) config, and where it is."""
    if "text_config" in doc.mapping(config):
        return dict(doc.table(config, "text_config")), doc.inner(": text_config")
    return dict(config), doc


def check_figures(config: Any, doc: Doc) -> None:
    """Every figure ``pair.facts_from_config`` reads, for its type and range."""
    doc.texts(config, "architectures", [])
    text, where = text_part(config, doc)
    layers = where.whole(text, "num_hidden_layers", least=1, most=MAX_LAYERS)
    where.whole(text, "hidden_size", least=1, most=MAX_WIDTH)
    heads = where.whole(text, "num_attention_heads", 1, least=1, most=MAX_WIDTH)
    where.whole(text, "num_key_value_heads", heads, least=1, most=heads)
    where.whole(text, "head_dim", None, least=1, most=MAX_WIDTH)
    where.whole(text, "vocab_size", 0, least=0, most=MAX_VOCAB)
    where.whole(text, "intermediate_size", None, least=1, most=MAX_WIDTH * 8)
    for key in ("dtype", "torch_dtype"):
        where.text(text, key, None)
    doc.text(config, "torch_dtype", None)
    where.flag(text, "tie_word_embeddings", None)
    types = where.texts(text, "layer_types", None)
    if types and len(types) != layers:
        where.fail(f"layer_types names {len(types)} layers, num_hidden_layers {layers}")
    for key in (
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
    ):
        where.whole(text, key, None, least=0, most=MAX_WIDTH)
    where.whole(text, "linear_conv_kernel_dim", None, least=1, most=1024)


def block_size(drafter: Any, doc: Doc) -> int | None:
    """A drafter's block, where its config states it (z-lab's at the top level, the
    reference package's in ``dflash_config``): a whole number of at least 2, one step's last
    token and at least one it drafts."""
    dflash = doc.table(drafter, "dflash_config", {})
    if "block_size" in doc.mapping(drafter):
        value: int = doc.whole(drafter, "block_size", least=2, most=MAX_LAYERS)
        return value
    inner = doc.inner(": dflash_config")
    block: int | None = inner.whole(dflash, "block_size", None, least=2, most=MAX_LAYERS)
    return block


def check_pair(target: Any, drafter: Any, target_doc: Doc, drafter_doc: Doc) -> None:
    """What a DFlash drafter needs of its target (both configs' figures checked already):
    the layers it reads are the target's, and its width is the target's (it reads the
    target's hidden states and embeddings)."""
    target_text, _ = text_part(target, target_doc)
    drafter_text, drafter_where = text_part(drafter, drafter_doc)
    layers = target_text["num_hidden_layers"]
    dflash = drafter_doc.table(drafter, "dflash_config")
    inner = drafter_doc.inner(": dflash_config")
    ids = inner.wholes(dflash, "target_layer_ids")
    # Layer id + 1 is captured (HF's hidden_states[id + 1]): the target's last layer's
    # output is after its final norm, so the ids run to num_hidden_layers - 2.
    beyond = [i for i in ids if not 0 <= i <= layers - 2]
    if beyond:
        inner.fail(
            f"target_layer_ids {list(ids)}: {beyond[0]} is no layer the target's "
            f"{layers} give the drafter (0 to {layers - 2})"
        )
    block_size(drafter, drafter_doc)
    width, target_width = drafter_text["hidden_size"], target_text["hidden_size"]
    if width != target_width:
        drafter_where.fail(
            f"hidden_size {width} is not the target's {target_width}: a DFlash drafter reads "
            "the target's hidden states and embeddings at the target's width"
        )


def safetensors_bytes(path: Path) -> int:
    """The tensor bytes one safetensors file declares in its header (the file need not hold
    them: only the header is read, its length bounded first)."""
    doc = Doc(str(path), SmokePairError)
    try:
        with path.open("rb") as f:
            first = f.read(8)
            if len(first) < 8:
                doc.fail("no safetensors header (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", first)
            size = path.stat().st_size
            if length > min(HEADER_LIMIT, size - 8):
                doc.fail(
                    f"its header claims {length} bytes, past the file's {size} or the format's "
                    f"limit of {HEADER_LIMIT}"
                )
            header = json.loads(f.read(length))
    except OSError as e:
        doc.fail(f"cannot read it ({e.strerror or e})")
    except ValueError as e:
        doc.fail(f"its header is not JSON ({e})")
    ends = [0]
    for name, entry in doc.mapping(header).items():
        if name == "__metadata__":
            continue
        offsets = doc.inner(f": {name}").wholes(entry, "data_offsets")
        if len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
            doc.inner(f": {name}").fail(f"data_offsets {list(offsets)} is not [begin, end]")
        ends.append(offsets[1])
    return max(ends)
