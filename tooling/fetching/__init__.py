"""Stage 1, fetch: the pinned upstream vLLM (official wheel + sdist from a simple index, or a git
ref) brought into the cache and checked against ``patches/bases.toml``; runs in the toolchain.

``upstream.fetch_upstream`` is the stage's entry; ``bases`` reads the pins, ``fetch`` the index
downloads, ``gitsource`` the git remotes.
"""
