"""Stage 6, release: the release files beside the wheel (``release``: notes, manifest,
SHA256SUMS) and the offline wheelhouse for an air-gapped GPU host (``bundle``, carrying
``bundle_files/install.sh`` and ``join.py``, which run on that host); runs in the toolchain.
"""
