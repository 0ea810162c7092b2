"""Stage 4, verify: an installed vLLM checked like ``rpm -V`` (every file against RECORD, the
bytecode it would run, its version identity) and each fix by its probe; runs in the toolchain,
asking the install's interpreter (``inside/``) and the probe interpreter (``tooling.probes``).

``request.verify_requested`` is the stage's entry (the install an interpreter, a site-packages
folder or a wheel names, and who probes it), ``verify.verify`` the check itself; ``install``
pip-installs a wheel under test, ``bytecode`` compares the ``.pyc`` files with their sources.
"""
