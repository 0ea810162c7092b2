"""The ordered patch series (``patches/series.toml``) as typed data.

The series file is the ledger: for each patch, why it exists, where upstream
fixed it, which files it touches, the sha256 of its patch file and the probe
that proves its behaviour. Loading it checks every patch file's digest, so a
patch edited by hand without updating the ledger is refused before anything
is applied.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SeriesError
from ..fetching.bases import load_bases
from ..fsutil import sha256_file
from ..probing import probe_modules
from ..schema import Doc

logger = logging.getLogger(__name__)

_ID = re.compile(r"^[a-z0-9][a-z0-9-]*$")

#: Paths whose change means the compiled kernels no longer match the source.
COMPILED_PATTERNS = (
    re.compile(r"^csrc/"),
    re.compile(r"^cmake/"),
    re.compile(r"(^|/)CMakeLists\.txt$"),
    re.compile(r"^setup\.py$"),
    re.compile(r"\.(cu|cuh|cpp|cc|c|h|hpp)$"),
)


def is_compiled_path(path: str) -> bool:
    return any(p.search(path) for p in COMPILED_PATTERNS)


@dataclass(frozen=True)
class Patch:
    id: str
    index: int
    """1-based position in the series."""
    file: Path
    sha256: str
    title: str
    why: str
    probe: str
    files: tuple[str, ...]
    touches_compiled_code: bool
    upstream: tuple[str, ...] = ()
    upstream_fixed_in: str | None = None
    drop_when: str = ""
    requires: tuple[str, ...] = ()
    """Earlier patches whose lines this one is written on: it cannot go in without them."""

    @property
    def label(self) -> str:
        return f"{self.index:04d}-{self.id}"


@dataclass(frozen=True)
class Series:
    path: Path
    patches: tuple[Patch, ...]
    validated_base: str | None = None
    """The release the patches were written and tested against."""
    skipped: tuple[str, ...] = field(default=())

    @property
    def digest(self) -> str:
        """sha256 over the ordered (id, patch sha256) pairs and the skips: the series identity."""
        lines = [f"{p.id} {p.sha256}\n" for p in self.patches]
        lines += [f"skip {s}\n" for s in self.skipped]
        return hashlib.sha256("".join(lines).encode()).hexdigest()

    @property
    def probes(self) -> tuple[str, ...]:
        """The probes of this series' patches, in series order, each once."""
        return tuple(dict.fromkeys(p.probe for p in self.patches))

    def get(self, patch_id: str) -> Patch:
        for p in self.patches:
            if p.id == patch_id:
                return p
        raise SeriesError(
            f"no patch {patch_id!r} in {self.path} (have {', '.join(p.id for p in self.patches)})"
        )

    def without(self, skip: list[str]) -> Series:
        """The series minus ``skip`` (ids checked), remembering what was skipped."""
        for s in skip:
            self.get(s)
        kept = tuple(p for p in self.patches if p.id not in skip)
        for patch in kept:
            needed = [r for r in patch.requires if r in skip]
            if needed:
                raise SeriesError(
                    f"--skip {needed[0]}: patch {patch.id} is written on it; skip {patch.id} too"
                )
        return Series(
            self.path, kept, self.validated_base, tuple(sorted(set(self.skipped) | set(skip)))
        )


#: The keys a ``[[patch]]`` entry may hold; any other is a typo that would be ignored.
PATCH_KEYS = frozenset(
    {
        "id",
        "file",
        "sha256",
        "title",
        "why",
        "probe",
        "files",
        "touches_compiled_code",
        "upstream",
        "upstream_fixed_in",
        "drop_when",
        "requires",
    }
)
#: The ledger's own keys, beside its patches.
LEDGER_KEYS = frozenset({"validated_base", "patch"})


def _patch(entry: dict, index: int, folder: Path, doc: Doc) -> Patch:
    """One ``[[patch]]`` entry, every value checked against its type (a string where a
    list is due would be read letter by letter, ``"no"`` as true)."""
    doc.only_keys(entry, PATCH_KEYS)
    patch_id = doc.text(entry, "id")
    if not _ID.match(patch_id):
        doc.fail(f"id {patch_id!r} is not lower-case-with-dashes")
    file = doc.file_name(entry, "file", f" in {folder}")
    sha = doc.sha256(entry, "sha256")
    files = doc.texts(entry, "files")
    if not files:
        doc.fail("files is empty: a patch touches at least one file")
    probe = doc.text(entry, "probe")
    known = probe_modules()
    if probe not in known:
        doc.fail(f"probe {probe!r} is no module of tooling/probes (have {', '.join(known)})")
    return Patch(
        id=patch_id,
        index=index,
        file=folder / file,
        sha256=sha,
        title=doc.text(entry, "title"),
        why=doc.text(entry, "why").strip(),
        probe=probe,
        files=files,
        touches_compiled_code=doc.flag(entry, "touches_compiled_code"),
        upstream=doc.texts(entry, "upstream", ()),
        upstream_fixed_in=doc.text(entry, "upstream_fixed_in", None),
        drop_when=doc.text(entry, "drop_when", "").strip(),
        requires=doc.texts(entry, "requires", ()),
    )


def check_digest(patch: Patch) -> None:
    """Refuse a patch file that is missing or differs from the ledger."""
    if not patch.file.is_file():
        raise SeriesError(f"patch {patch.id}: file {patch.file} is missing")
    actual = sha256_file(patch.file)
    if actual != patch.sha256:
        raise SeriesError(
            f"patch {patch.id}: {patch.file.name} has sha256 {actual}, "
            f"but series.toml records {patch.sha256}"
        )


def load_series(path: Path, *, check_digests: bool = True) -> Series:
    """Parse ``series.toml``; by default also verify every patch file's sha256."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SeriesError(f"{path}: no such series file") from None
    except OSError as e:
        raise SeriesError(f"{path}: cannot read the series file ({e.strerror or e})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SeriesError(f"{path}: not valid TOML ({e})") from None
    doc = Doc(str(path), SeriesError)
    doc.only_keys(data, LEDGER_KEYS)
    entries = doc.tables(data, "patch", [])
    if not entries:
        raise SeriesError(f"{path}: lists no patches")
    patches = tuple(
        _patch(e, i, path.parent.resolve(), doc.inner(f": patch #{i}"))
        for i, e in enumerate(entries, start=1)
    )
    ids = [p.id for p in patches]
    if len(set(ids)) != len(ids):
        raise SeriesError(f"{path}: duplicate patch ids in {ids}")
    for p in patches:
        earlier = ids[: p.index - 1]
        for required in p.requires:
            if required not in earlier:
                raise SeriesError(
                    f"{path}: patch {p.id} requires {required!r}, which is not an earlier patch"
                )
    if check_digests:
        for p in patches:
            check_digest(p)
    validated = doc.text(data, "validated_base", None)
    logger.debug("%s: %d patches, validated on %s", path, len(patches), validated or "none")
    return Series(path=path, patches=patches, validated_base=validated or None)


def load_ledger(patches_dir: Path, *, check_digests: bool = True) -> Series:
    """``patches_dir``'s series, whose ``validated_base`` must be a release its bases.toml
    pins: the build records it, and ``--3way`` seeds its blobs."""
    series = load_series(patches_dir / "series.toml", check_digests=check_digests)
    known = list(load_bases(patches_dir / "bases.toml").bases)
    if series.validated_base is not None and series.validated_base not in known:
        raise SeriesError(
            f"{series.path}: validated_base {series.validated_base!r} is not a release "
            f"bases.toml pins ({', '.join(known)})"
        )
    return series
