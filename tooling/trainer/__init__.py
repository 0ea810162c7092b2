"""Offline training of a small Qwen3 target and a DFlash drafter, and reference acceptance.

Runs on a GPU host with only torch, transformers, tokenizers, safetensors, numpy
and the reference ``dflash`` package: of the rest of ``tooling`` it imports only
``errors`` and ``paths``, which need the standard library alone. ``api.train_in``
runs the recipe (``recipe.train``) in such an interpreter and returns the
trained pair (``tooling train``, ``tooling smoke --trained``); ``config``,
``corpus`` and ``api`` need the standard library alone.
"""
