"""Stage 3, build: the patched wheel, by default the official wheel's members copied as stored
bytes with the patched files swapped in, plus the build manifest and SBOM; or vLLM's own build of
the patched tree (``source_build``). Runs in the toolchain (source mode drives ``--build-python``).

``request.build_requested`` is the stage's entry (fetch, patch in the locked work tree, build);
``build.build_precompiled`` and ``source_build.build_from_source`` build the two modes;
``wheelfile`` writes the zip, ``manifest`` and ``sbom`` the records inside ``.dist-info``.
"""
