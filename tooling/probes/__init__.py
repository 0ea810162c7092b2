"""The behavioural probes, one module per fix, and what runs them inside the probed interpreter.

Everything in this package runs in another interpreter (one with torch and vLLM's import-time
dependencies), copied there under a neutral name (``tooling.probing.package``): its modules
import only the standard library, torch, transformers, vLLM and each other, never the rest of
the toolchain. Starting, caching and collecting runs is ``tooling.probing``.
"""
