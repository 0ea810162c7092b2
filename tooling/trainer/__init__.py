"""Offline training of a small Qwen3 target and a DFlash drafter, and reference acceptance.

Runs on a GPU host with only torch, transformers, tokenizers, safetensors, numpy
and the reference ``dflash`` package: nothing here imports the rest of
``tooling``. ``python -m tooling.trainer train`` runs the whole recipe
(``recipe.main``); ``corpus`` and ``config`` need the standard library alone.
"""
