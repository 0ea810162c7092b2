"""A byte-level BPE tokenizer trained on the corpus, saved as a Hugging Face tokenizer.

Uses the ``tokenizers`` library only; the HF files are written here by hand, so
what lands on disk does not depend on the transformers version (any transformers
5.x and vLLM's loader read ``PreTrainedTokenizerFast``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ..errors import TrainingError

logger = logging.getLogger(__name__)

EOT = "<|endoftext|>"
MASK = "<|mask|>"
# Special tokens come first, so their ids are fixed whatever the corpus.
SPECIAL_TOKENS = (EOT, MASK)
EOT_ID = 0
MASK_ID = 1
#: Qwen3.5's split before byte-level BPE. transformers loads a ``qwen3_5`` model's tokenizer
#: as its own ``Qwen3_5Tokenizer``, which keeps the vocabulary and merges of
#: tokenizer.json but normalizes (NFC) and splits this way: a hybrid target's tokenizer is
#: trained so, and encodes alike whichever class loads it.
QWEN3_5_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, qwen3_5: bool = False) -> Tokenizer:
    """A byte-level BPE tokenizer with at most ``vocab_size`` tokens, specials at ids 0 and 1;
    ``qwen3_5``: with Qwen3.5's normalizer and split (``QWEN3_5_SPLIT``)."""
    tok = Tokenizer(models.BPE())
    if qwen3_5:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN3_5_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any text encodes, even bytes absent from the corpus.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if tok.token_to_id(EOT) != EOT_ID or tok.token_to_id(MASK) != MASK_ID:
        raise TrainingError("tokenizer: special tokens did not get ids 0 and 1")
    return tok


def tokenizer_digest(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def encode_texts(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text (int32 arrays), encoded in parallel by the library."""
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encodings]


def join_documents(docs: list[np.ndarray]) -> np.ndarray:
    """One stream: each document followed by the end-of-text token."""
    if not docs:
        return np.zeros(0, dtype=np.int32)
    eot = np.asarray([EOT_ID], dtype=np.int32)
    return np.concatenate([part for d in docs for part in (d, eot)])


def save_hf_tokenizer(tok: Tokenizer, directory: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    logger.debug("save the tokenizer into %s", directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    added = {
        str(i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, content in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOT,
        "pad_token": EOT,
        "mask_token": MASK,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    special = {"eos_token": EOT, "pad_token": EOT, "mask_token": MASK}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
