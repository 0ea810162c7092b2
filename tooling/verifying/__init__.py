"""Stage 4, verify: an installed vLLM checked like ``rpm -V`` (every file against RECORD, the
bytecode it would run, its version identity) and each fix by its probe; runs in the toolchain,
asking the install's interpreter (``inside/``) and the probe interpreter (``tooling.probes``).

``verify.verify`` is the stage's entry; ``install`` pip-installs a wheel under test, ``bytecode``
compares the ``.pyc`` files with their sources.
"""
