"""Minimal valid wheels built in the tests, for installers to work on offline."""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(
    folder: Path,
    name: str,
    version: str,
    requires: str = "",
    payload: int = 0,
    modules: dict[str, bytes] | None = None,
) -> Path:
    """A pure-Python wheel of package ``name``: ``payload`` bytes of incompressible data
    inside, and ``modules`` (file name in the package: its bytes) beside ``__init__``."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n".encode(),
        f"{name}/blob.bin": os.urandom(payload),
        **{f"{name}/{file}": data for file, data in (modules or {}).items()},
        f"{dist}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n"
            + (f"Requires-Dist: {requires}\n" if requires else "")
        ).encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{n},{_record_hash(d)},{len(d)}\n" for n, d in files.items())
    record += f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for member, data in files.items():
            zf.writestr(member, data)
        zf.writestr(f"{dist}/RECORD", record)
    return path
