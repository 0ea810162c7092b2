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
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

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


class CodeState(StrEnum):
    """What a fix is on a ported base (``[patch.on."BASE"]``)."""

    PORT = "port"
    """Its own patch file for that base, in ``patches/BASE/``."""
    SUPERSEDED = "superseded"
    """The base already behaves as fixed: its probe must read present there, or it is a
    conflict (a claim the tree does not bear out is never a silent skip)."""
    NOT_NEEDED = "not-needed"
    """The code path the defect lived in is gone on that base (``why`` says what replaced it)."""


@dataclass(frozen=True)
class BaseCode:
    """A fix's code on one ported base."""

    state: CodeState
    why: str
    file: Path | None = None
    """The port's patch file (PORT only)."""
    sha256: str | None = None
    files: tuple[str, ...] = ()


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
    on: Mapping[str, BaseCode] = field(default_factory=dict)
    """Its code on each ported base that names it (``[patch.on."BASE"]``)."""
    base: str | None = None
    """Set in a series resolved for a ported base (``Series.for_base``) that names this fix's
    code; None: the patch file as it is."""

    @property
    def label(self) -> str:
        return f"{self.index:04d}-{self.id}"

    @property
    def code(self) -> BaseCode | None:
        """What the ledger says the fix is on the base it was resolved for."""
        return self.on[self.base] if self.base is not None else None

    @property
    def expect(self) -> CodeState | None:
        return self.code.state if self.code else None

    @property
    def ledger_file(self) -> str:
        """The patch file as the ledger names it, relative to ``patches/`` (a port's in its
        base's folder): the work tree's trailer, and the name ``patch export`` writes."""
        if self.expect is CodeState.PORT:
            return f"{self.base}/{self.file.name}"
        return self.file.name

    @property
    def carried(self) -> bool:
        """True when the patch brings code to the tree it is resolved for (not a fix the base
        already has, or does not need)."""
        return self.expect in (None, CodeState.PORT)


@dataclass(frozen=True)
class Series:
    path: Path
    patches: tuple[Patch, ...]
    validated_base: str | None = None
    """The release the patches were written and tested against."""
    skipped: tuple[str, ...] = field(default=())
    ported_bases: tuple[str, ...] = ()
    """Releases on which every fix names its own code (``[patch.on."BASE"]``): a port, or
    superseded, or not needed. Any other release takes the patch files as they are."""
    base: str | None = None
    """The ported base this series was resolved for (``for_base``); None: not resolved."""

    @property
    def digest(self) -> str:
        """sha256 over the ordered (id, patch sha256) pairs and the skips: the series identity.
        On a ported base a fix that brings no code counts by its state, not a file's digest."""
        lines = [f"{p.id} {p.sha256 if p.carried else p.expect}\n" for p in self.patches]
        lines += [f"skip {s}\n" for s in self.skipped]
        return hashlib.sha256("".join(lines).encode()).hexdigest()

    @property
    def carried(self) -> tuple[Patch, ...]:
        """The patches that bring code (all of them, but on a ported base)."""
        return tuple(p for p in self.patches if p.carried)

    def for_base(self, version: str, *, strict: bool) -> Series:
        """The series as it applies to the release ``version`` (pure).

        Not a ported base: this series. A ported base: each fix's code named there (a port's
        file, or the state it is expected to be in). A fix that names none is refused when
        ``strict`` (a build: one line naming the base and the fix); otherwise it is tried
        with its own patch file, which the canary then reports as what it comes to."""
        if version not in self.ported_bases or self.base == version:
            return self
        patches = []
        for patch in self.patches:
            code = patch.on.get(version)
            if code is None:
                if strict:
                    raise SeriesError(
                        f"base {version}: fix {patch.id} has no code for it (series.toml names "
                        f'no port, superseded or not-needed in [patch.on."{version}"]); '
                        f"--skip {patch.id} builds without it, named in the version"
                    )
                patches.append(patch)
                continue
            patches.append(
                replace(
                    patch,
                    file=code.file or patch.file,
                    sha256=code.sha256 or patch.sha256,
                    files=code.files or patch.files,
                    base=version,
                )
            )
        carried = {p.id for p in patches if p.carried}
        # A fix is written on the lines of those it requires only where both bring code.
        patches = [
            replace(p, requires=tuple(r for r in p.requires if p.carried and r in carried))
            for p in patches
        ]
        return replace(self, patches=tuple(patches), base=version)

    def without_code_on(self, version: str) -> tuple[str, ...]:
        """The fixes that name no code for the ported base ``version`` (pure): what a
        candidate build there leaves out, and records in its version. Empty off a ported
        base, where every patch file is tried as it is."""
        if version not in self.ported_bases:
            return ()
        return tuple(p.id for p in self.patches if version not in p.on)

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

    def without(self, skip: list[str], base: str | None = None) -> Series:
        """The series minus ``skip`` (ids checked), remembering what was skipped. A patch
        written on a skipped one is refused unless skipped too, on ``base`` where given: on a
        ported base a fix it has already (superseded there) brings no lines to be written on."""
        for s in skip:
            self.get(s)
        kept = tuple(p for p in self.patches if p.id not in skip)
        resolved = self.for_base(base, strict=False) if base is not None else self
        requires = {p.id: p.requires for p in resolved.patches}
        for patch in kept:
            needed = [r for r in requires[patch.id] if r in skip]
            if needed:
                raise SeriesError(
                    f"--skip {needed[0]}: patch {patch.id} is written on it; skip {patch.id} too"
                )
        return replace(self, patches=kept, skipped=tuple(sorted(set(self.skipped) | set(skip))))


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
        "on",
    }
)
#: The keys of a fix's code on a ported base.
ON_KEYS = frozenset({"state", "why", "file", "sha256", "files"})
#: The ledger's own keys, beside its patches.
LEDGER_KEYS = frozenset({"validated_base", "ported_bases", "patch"})


def _base_code(entry: Any, base: str, folder: Path, doc: Doc) -> BaseCode:
    """One ``[patch.on."BASE"]`` table: a port names its file (in ``patches/BASE/``) and
    sha256; superseded and not-needed say why, and name no file."""
    doc.only_keys(entry, ON_KEYS)
    states = ", ".join(s.value for s in CodeState)
    raw = doc.text(entry, "state")
    try:
        state = CodeState(raw)
    except ValueError:
        doc.fail(f"state {raw!r} is not one of {states}")
    # One line: it is a status table's cell and a message.
    why = " ".join(doc.text(entry, "why").split())
    if not why:
        doc.fail("why is empty: say what the fix is on this base, and how that is known")
    if state is not CodeState.PORT:
        for key in ("file", "sha256", "files"):
            if key in entry:
                doc.fail(f"{key} is for a port; a fix {state.value} on {base} brings no code")
        return BaseCode(state, why)
    # Named with its base's folder, so that no two entries of the ledger name one file.
    file: str = doc.text(entry, "file")
    bare = file.removeprefix(f"{base}/")
    if bare == file or Path(bare).name != bare or bare in ("", ".", ".."):
        doc.fail(f"file {file!r} is not {base}/NAME (a port lives in patches/{base}/)")
    return BaseCode(
        state,
        why,
        file=folder / base / bare,
        sha256=doc.sha256(entry, "sha256"),
        files=doc.texts(entry, "files", ()),
    )


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
    on = {
        base: _base_code(code, base, folder, doc.inner(f' [on."{base}"]'))
        for base, code in doc.table(entry, "on", {}).items()
    }
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
        on=on,
    )


def _check_file(patch_id: str, file: Path, sha256: str) -> None:
    if not file.is_file():
        raise SeriesError(f"patch {patch_id}: file {file} is missing")
    actual = sha256_file(file)
    if actual != sha256:
        raise SeriesError(
            f"patch {patch_id}: {file.name} has sha256 {actual}, but series.toml records {sha256}"
        )


def check_digest(patch: Patch) -> None:
    """Refuse a patch file (or a port's) that is missing or differs from the ledger."""
    _check_file(patch.id, patch.file, patch.sha256)
    for code in patch.on.values():
        if code.file is not None and code.sha256 is not None:
            _check_file(patch.id, code.file, code.sha256)


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
    ported = doc.texts(data, "ported_bases", ())
    for p in patches:
        for base in p.on:
            if base not in ported:
                raise SeriesError(
                    f'{path}: patch {p.id} names code for {base} ([patch.on."{base}"]), '
                    f"which ported_bases does not list ({', '.join(ported) or 'none'})"
                )
    if check_digests:
        for p in patches:
            check_digest(p)
    validated = doc.text(data, "validated_base", None)
    logger.debug("%s: %d patches, validated on %s", path, len(patches), validated or "none")
    return Series(path=path, patches=patches, validated_base=validated or None, ported_bases=ported)


def load_ledger(patches_dir: Path, *, check_digests: bool = True) -> Series:
    """``patches_dir``'s series, whose ``validated_base`` must be a release its bases.toml
    pins: the build records it, and ``--3way`` seeds its blobs."""
    series = load_series(patches_dir / "series.toml", check_digests=check_digests)
    known = list(load_bases(patches_dir / "bases.toml").bases)
    named = [("validated_base", series.validated_base)]
    named += [("ported_bases", b) for b in series.ported_bases]
    for key, base in named:
        if base is not None and base not in known:
            raise SeriesError(
                f"{series.path}: {key} {base!r} is not a release bases.toml pins "
                f"({', '.join(known)})"
            )
    if series.validated_base in series.ported_bases:
        raise SeriesError(
            f"{series.path}: ported_bases lists the validated base {series.validated_base}, "
            "whose code is the patch files themselves"
        )
    return series
