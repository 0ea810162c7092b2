"""Stage 2, patch: the series (``patches/series.toml``) applied to an upstream tree in a git work
tree, one commit per patch, each with one status; runs in the toolchain (the probes it asks run in
the probe interpreter, see ``tooling.probes``).

``request.patch_requested`` and ``request.export_requested`` are the commands' entries,
``apply.apply_series`` the engine; ``series`` reads the ledger, ``hunks`` and
``worktree`` do the text and git work, ``export`` writes ``patches/`` back, ``status`` is the
canary (every patch on every pinned release).
"""
