"""A second zlib for the reproducibility test: zlib-ng built as a ``libz.so.1``.

A wheel must not depend on the zlib of the Python that builds it. To test
that, a test runs the same interpreter with another ``libz.so.1`` in front
(``LD_LIBRARY_PATH``): zlib-ng in its zlib-compatible mode, which some Linux
distributions and Python builds link instead of zlib, and whose deflate writes
other bytes for the same input. Its sources come from the pinned sdist of the
zlib-ng package on PyPI (the module there vendors them); cmake and the C
compiler build them once into pytest's cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

#: Set to a folder holding another ``libz.so.1`` to use that one instead of building.
OTHER_LIBZ_VAR = "TOOLING_TEST_LIBZ"
SDIST_REQUIREMENT = "zlib-ng==1.1.0"
SDIST = "zlib_ng-1.1.0.tar.gz"
SDIST_SHA256 = "08a3a8468d4f130e3dc80d28ec42fcc7a878a57dfed616233e791066327d78a3"
#: Where the zlib-ng sources lie in the unpacked sdist (zlib-ng 2.3.3).
SOURCES = "zlib_ng-1.1.0/src/zlib_ng/zlib-ng"


def missing_tools() -> list[str]:
    return [tool for tool in ("cmake", "cc") if shutil.which(tool) is None]


def build_zlib_ng(folder: Path) -> Path:
    """Build zlib-ng's ``libz.so.1`` into ``folder``; the caller holds its lock."""
    with tempfile.TemporaryDirectory(prefix="zlib-ng-") as tmp:
        work = Path(tmp)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--dest",
                str(work),
                SDIST_REQUIREMENT,
            ],
            check=True,
            capture_output=True,
        )
        sdist = work / SDIST
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise AssertionError(f"{SDIST}: sha256 {digest}, pinned {SDIST_SHA256}")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        build = work / "build"
        configure = [
            "cmake",
            "-S",
            str(work / SOURCES),
            "-B",
            str(build),
            "-DZLIB_COMPAT=ON",
            "-DBUILD_SHARED_LIBS=ON",
            "-DBUILD_TESTING=OFF",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        subprocess.run(configure, check=True, capture_output=True)
        jobs = str(max(1, min(2, os.cpu_count() or 1)))
        subprocess.run(
            ["cmake", "--build", str(build), "--target", "zlib-ng", "--parallel", jobs],
            check=True,
            capture_output=True,
        )
        folder.mkdir(parents=True, exist_ok=True)
        staged = folder / "libz.so.1.tmp"
        shutil.copyfile(build / "libz.so.1", staged)  # the file its symlink names
        staged.replace(folder / "libz.so.1")
    return folder
