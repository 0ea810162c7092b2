"""The output wheel's identity: its name, version and tags (pure), the version stamped into
``vllm/_version.py`` so vLLM's own caches tell this build from stock, and the wheel's METADATA,
WHEEL and RECORD files as the build rewrites or reads them."""

from __future__ import annotations

import csv
import io
import re
import zipfile
from dataclasses import dataclass

from packaging.utils import parse_wheel_filename
from packaging.version import Version

from ..errors import BuildError
from ..fsutil import sha256_bytes
from ..patching.series import Series
from .manifest import ChangedFile
from .wheelfile import read_member

LOCAL_LABEL = "dflash"
#: The module vLLM reads ``vllm.__version__`` from; the build stamps it (see ``stamp_version``).
VERSION_FILE = "vllm/_version.py"
#: The owner the manifest names for the stamped VERSION_FILE (it belongs to no patch).
VERSION_STAMP = "version-stamp"


@dataclass(frozen=True)
class WheelIdentity:
    name: str
    version: str
    build_tag: str | None
    tags: str
    """The compressed tag triple exactly as the official file name spells it."""

    @property
    def filename(self) -> str:
        build = f"-{self.build_tag}" if self.build_tag else ""
        return f"{self.name}-{self.version}{build}-{self.tags}.whl"

    @property
    def dist_info(self) -> str:
        return f"{self.name}-{self.version}.dist-info"


def plan_identity(
    official_filename: str, series: Series, build_tag: str | None = None
) -> WheelIdentity:
    """Name and version of the output wheel (pure).

    Default: the base version plus a local label ``dflash.<patches>.<series digest>``,
    keeping the official build tag. With ``build_tag``: the base version
    unchanged (PyPI refuses local labels) and the given build tag, which must
    sort above the official one so installers prefer ours.
    """
    _, version, official_build, _ = parse_wheel_filename(official_filename)
    stem = official_filename.removesuffix(".whl").split("-")
    tags = "-".join(stem[-3:])
    dist = stem[0]
    if build_tag is None:
        new_version = runtime_version(str(version), series)
        keep = f"{official_build[0]}{official_build[1]}" if official_build else None
        return WheelIdentity(dist, new_version, keep, tags)
    tag = re.fullmatch(r"(\d+)[A-Za-z0-9_]*", build_tag)
    if tag is None:
        raise BuildError(f"--build-tag {build_tag!r}: must start with a digit (PEP 427)")
    if official_build and int(tag.group(1)) <= official_build[0]:
        raise BuildError(
            f"--build-tag {build_tag}: must be above the official build tag {official_build[0]}"
        )
    return WheelIdentity(dist, str(version), build_tag, tags)


def runtime_version(base_version: str, series: Series) -> str:
    """The version a build of ``series`` reports as ``vllm.__version__`` (pure).

    The base version plus the local label ``dflash.<patches>.<series digest>``
    (and the skipped patches): whatever the wheel's file name, vLLM's own
    caches (compiled graphs, keyed by ``vllm.__version__`` among others) and
    ``/version`` must tell this build from stock and from other series.
    """
    label = f"{LOCAL_LABEL}.{len(series.patches)}.{series.digest[:8]}"
    if series.skipped:
        label += ".skip." + ".".join(s.replace("-", "") for s in series.skipped)
    stamped = f"{Version(base_version).public}+{label}"
    Version(stamped)
    return stamped


_VERSION_LINE = re.compile(r"^__version__ = version = .*$", re.M)
_VERSION_TUPLE_LINE = re.compile(r"^__version_tuple__ = version_tuple = .*$", re.M)


def stamp_version(text: str, version: str) -> str:
    """``vllm/_version.py`` (as setuptools-scm writes it) reporting ``version`` (pure).

    The tuple keeps setuptools-scm's shape: the release numbers, then the
    local label as one string (vLLM reads its first two items).
    """
    parsed = Version(version)
    items = [*parsed.release] + ([parsed.local] if parsed.local else [])
    for pattern, line in (
        (_VERSION_LINE, f"__version__ = version = {version!r}"),
        (_VERSION_TUPLE_LINE, f"__version_tuple__ = version_tuple = {tuple(items)!r}"),
    ):
        text, count = pattern.subn(line, text)
        if count != 1:
            raise BuildError(
                f"{VERSION_FILE}: expected one line matching {pattern.pattern!r}, found {count}"
            )
    return text


def version_stamp(source: zipfile.ZipFile, version: str) -> tuple[bytes, ChangedFile]:
    """The stamped VERSION_FILE for a wheel built from ``source``, and its manifest entry."""
    before = read_member(source, VERSION_FILE)
    after = stamp_version(before.decode("utf-8"), version).encode("utf-8")
    entry = ChangedFile(VERSION_FILE, [VERSION_STAMP], sha256_bytes(before), sha256_bytes(after))
    return after, entry


def rewrite_metadata(text: str, version: str) -> str:
    head, sep, body = text.partition("\n\n")
    lines = head.split("\n")
    hits = [i for i, line in enumerate(lines) if line.startswith("Version: ")]
    if len(hits) != 1:
        raise BuildError("official METADATA has no single Version header")
    lines[hits[0]] = f"Version: {version}"
    return "\n".join(lines) + sep + body


def rewrite_wheel_file(text: str, identity: WheelIdentity) -> str:
    """WHEEL with Tag lines that match the file name (the official one says linux_x86_64)."""
    python, abi, platforms = identity.tags.split("-")
    tags = [
        f"{p}-{a}-{pl}"
        for p in python.split(".")
        for a in abi.split(".")
        for pl in platforms.split(".")
    ]
    kept = [ln for ln in text.splitlines() if ln and not ln.startswith(("Tag:", "Build:"))]
    if identity.build_tag:
        kept.append(f"Build: {identity.build_tag}")
    kept += [f"Tag: {t}" for t in tags]
    return "\n".join(kept) + "\n\n"


def parse_record(data: bytes) -> dict[str, tuple[str, str]]:
    rows = csv.reader(io.StringIO(data.decode("utf-8")))
    return {row[0]: (row[1], row[2]) for row in rows if row}
