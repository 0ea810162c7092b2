"""Build-and-patch toolchain for a fixed vLLM distribution for DFlash speculative decoding.

The pipeline, one module per stage: ``fetch`` (and ``gitsource``) -> ``apply``
(patch series on a git work tree, checked by ``probes``) -> ``build`` (the
patched CUDA wheel) -> ``verify`` (an installed environment) -> ``smoke``
(a real server on a GPU). ``cli`` is the only Click module.
"""

import os

# GitPython refuses to import without a git executable; most commands need none
# (verify, release, --help), and those that do say so in one line (cli.py).
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")

__version__ = "0.1.0"
