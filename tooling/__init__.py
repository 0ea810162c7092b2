"""Build-and-patch toolchain for a fixed vLLM distribution for DFlash speculative decoding.

The pipeline, one module per stage: ``fetch`` (and ``gitsource``) -> ``apply``
(patch series on a git work tree, checked by ``probes``) -> ``build`` (the
patched CUDA wheel) -> ``verify`` (an installed environment) -> ``smoke``
(a real server on a GPU). ``cli`` is the only Click module.
"""

__version__ = "0.1.0"
