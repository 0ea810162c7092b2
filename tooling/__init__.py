"""Build-and-patch toolchain for a fixed vLLM distribution for DFlash speculative decoding.

The pipeline, one sub-package per stage: ``fetching`` (the pinned upstream) ->
``patching`` (the series on a git work tree, checked by ``probes``) -> ``building``
(the patched CUDA wheel) -> ``verifying`` (an installed environment) -> ``smoke``
(a real server on a GPU) -> ``release`` (release files, offline bundle). ``cli`` holds
the Click commands, one module each; the shared helpers stay at this level.
"""

__version__ = "0.1.0"
