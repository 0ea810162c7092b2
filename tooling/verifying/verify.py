"""Verify an installed vLLM: every file against RECORD, and every fix by behaviour.

Like ``rpm -V``: silent when all is well, a line per problem otherwise, and
a modified file is named together with the patch that owns it when the
build manifest knows one. The fixes are decided by the probes, never by
reading files, so a fix that lives elsewhere or under another name (a
later upstream release) is still found.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from .. import procs
from ..building.manifest import MANIFEST_NAME, BuildManifest
from ..errors import (
    EnvironmentProblem,
    ProbeError,
    ToolingError,
    VerifyFixMissingError,
    VerifyIntegrityError,
    VllmNotFoundError,
)
from ..patching.registry import Fix, registry
from ..patching.series import CodeState
from ..probing import ABSENT, PRESENT, ProbeResult, ProbeTarget, start_probes
from .bytecode import BytecodeCheck, check_bytecode
from .install import pip_install

logger = logging.getLogger(__name__)

# The .dist-info folder is the distribution's own path, not found through its RECORD, whose
# damage is verify's to report: it is not a vLLM that is missing. Its one line on stdout is
# its answer (JSON), read back by locate_with_python.
_LOCATE = r"""
import json, os, importlib.metadata as md
try:
    dist = md.distribution("vllm")
except md.PackageNotFoundError:
    answer = None
else:
    site = str(dist.locate_file(""))
    folder = getattr(dist, "_path", None)
    answer = {
        "version": dist.version,
        "site": site,
        "dist_info": os.path.relpath(folder, site) if folder is not None else None,
    }
print(json.dumps(answer))
"""

_PURELIB = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
#: A RECORD line's hash and size: both empty (RECORD itself, bytecode), or set.
_RECORD_HASH = re.compile(r"^([a-z0-9_]+=[A-Za-z0-9_-]+)?$")
_SIZE = re.compile(r"^[0-9]*$")


@dataclass(frozen=True)
class InstalledDist:
    version: str
    site: Path
    """The folder RECORD paths are relative to."""
    dist_info: str
    """The .dist-info folder, relative to ``site``."""


@dataclass
class FileProblem:
    path: str
    kind: str
    """"missing", "modified", "unexpected", or "bytecode" (a .pyc Python would load in
    place of its unchanged source, compiled from other code)."""
    detail: str = ""
    patches: list[str] = field(default_factory=list)


@dataclass
class FixStatus:
    number: int
    patch_id: str
    probe: str
    state: FixState
    evidence: str
    form: str | None = None


@dataclass(frozen=True)
class VersionIdentity:
    """Which build this is, as pip, vLLM itself and our manifest each say.

    vLLM keys its compiled-graph caches (and ``/version``) by
    ``vllm.__version__``, so a build that reports stock's version shares
    stock's compiled graphs.
    """

    metadata: str
    """The version in the distribution's METADATA (what pip shows)."""
    runtime: str | None
    """``vllm.__version__`` as the probed interpreter imports it (None: import failed)."""
    stamped: str | None
    """What our build stamped into vllm/_version.py (None: not ours, or an unstamped build)."""
    built_by_us: bool

    @property
    def problem(self) -> str | None:
        if self.stamped is not None and self.runtime is not None and self.runtime != self.stamped:
            return (
                f"vllm.__version__ is {self.runtime} but the build stamped {self.stamped} "
                "(another vLLM is imported first, or vllm/_version.py was replaced)"
            )
        return None

    def describe(self) -> str:
        runtime = self.runtime or "unknown (vLLM did not import)"
        if self.problem:
            return f"identity: {self.problem}"
        if self.built_by_us and self.stamped is None:
            return (
                f"identity: vllm.__version__ {runtime} is not stamped by the build: compiled-graph "
                "caches cannot tell it from stock vLLM"
            )
        return f"identity: vllm.__version__ {runtime}, METADATA {self.metadata}"


@dataclass
class VerifyReport:
    dist: InstalledDist
    files_checked: int
    problems: list[FileProblem]
    manifest: BuildManifest | None
    fixes: list[FixStatus]
    required: list[int]
    identity: VersionIdentity
    bytecode: BytecodeCheck
    probes_cached: bool = False
    """The fixes' verdicts came from the probe cache, not a run of their own."""

    @property
    def integrity_ok(self) -> bool:
        return not self.problems and self.identity.problem is None

    @property
    def missing_fixes(self) -> list[FixStatus]:
        return [f for f in self.fixes if f.number in self.required and not f.state.satisfied]

    def raise_unless_ok(self) -> None:
        """The verdict as the command's failure: integrity first, then a required fix."""
        if self.identity.problem:
            raise VerifyIntegrityError(self.identity.problem)
        if not self.integrity_ok:
            first = self.problems[0]
            raise VerifyIntegrityError(
                f"{len(self.problems)} file(s) differ from RECORD, first: {first.kind} {first.path}"
                + (f" (patch {', '.join(first.patches)})" if first.patches else "")
            )
        if self.missing_fixes:
            names = ", ".join(f"{f.number} {f.patch_id} ({f.state})" for f in self.missing_fixes)
            raise VerifyFixMissingError(f"required fix not present: {names}")

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.integrity_ok and not self.missing_fixes,
            "vllm_version": self.dist.version,
            "location": str(self.dist.site),
            "dist_info": self.dist.dist_info,
            "built_by_us": self.manifest is not None,
            "identity": {**asdict(self.identity), "problem": self.identity.problem},
            "manifest": asdict(self.manifest) if self.manifest else None,
            "integrity": {
                "ok": self.integrity_ok,
                "files_checked": self.files_checked,
                "problems": [asdict(p) for p in self.problems],
                "bytecode": asdict(self.bytecode),
            },
            "fixes": [asdict(f) for f in self.fixes],
            "probes_cached": self.probes_cached,
            "required": self.required,
        }


def locate_with_python(python: Path) -> InstalledDist:
    """Ask ``python`` where its vLLM distribution is installed."""
    out = _ask(python, _LOCATE, f"cannot ask {python} for its vLLM", VllmNotFoundError)
    try:
        data = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise VllmNotFoundError(
            f"{python} is not a Python interpreter: it printed no answer"
        ) from None
    if data is None or not data.get("dist_info"):
        raise VllmNotFoundError(f"no vLLM distribution installed for {python}")
    site = Path(data["site"])
    return InstalledDist(data["version"], site, data["dist_info"])


def locate_in_site(site: Path) -> InstalledDist:
    """Find the one vllm-*.dist-info in a site-packages folder."""
    found = sorted(site.glob("vllm-*.dist-info"))
    if not found:
        raise VllmNotFoundError(f"no vllm-*.dist-info in {site}")
    if len(found) > 1:
        raise VllmNotFoundError(f"{site} holds several vLLM installs: {[p.name for p in found]}")
    try:
        metadata = (found[0] / "METADATA").read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise VllmNotFoundError(
            f"{found[0]} has no METADATA: not an installed distribution"
        ) from None
    version = next(
        (ln.split(":", 1)[1].strip() for ln in metadata.splitlines() if ln.startswith("Version:")),
        "?",
    )
    return InstalledDist(version, site, found[0].name)


def _record_digest(path: Path) -> str:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def read_record(dist: InstalledDist) -> list[tuple[str, str, str]]:
    """RECORD's rows (path, hash, size); a RECORD that is gone, empty or not one is a
    VerifyIntegrityError naming it: the install is damaged."""
    path = dist.site / dist.dist_info / "RECORD"

    def damaged(why: str) -> VerifyIntegrityError:
        return VerifyIntegrityError(f"{path}: RECORD {why}: this vLLM install is damaged")

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise damaged("is missing") from None
    except UnicodeDecodeError:
        raise damaged("is not text") from None
    except OSError as e:
        raise VllmNotFoundError(f"{path}: cannot read RECORD ({e.strerror})") from None
    try:
        rows = [r for r in csv.reader(io.StringIO(text)) if r]
    except csv.Error as e:
        raise damaged(f"is not CSV ({e})") from None
    if not rows:
        raise damaged("is empty")
    for number, row in enumerate(rows, 1):
        if len(row) != 3 or not row[0] or not _RECORD_HASH.match(row[1]) or not _SIZE.match(row[2]):
            raise damaged(f"line {number} is not a RECORD line (path,sha256=...,size)")
    return [(r[0], r[1], r[2]) for r in rows]


def installed_path(site: Path, rel: str) -> Path:
    """Where a RECORD entry lies. Entries outside site-packages (console scripts,
    ``../../bin/vllm``) are relative to it in a virtualenv; ``pip --target``
    moves the tree afterwards and they end up in ``<target>/bin`` instead."""
    path = site / rel
    if rel.startswith("../") and not path.exists():
        moved = site / "bin" / Path(rel).name
        if moved.exists():
            return moved
    return path


def check_files(dist: InstalledDist, workers: int = 2) -> tuple[int, list[FileProblem]]:
    """Hash every RECORD file (in parallel: hashlib releases the GIL) and look for strays."""
    rows = read_record(dist)
    checked = [(p, h, s) for p, h, s in rows if h]
    problems: list[FileProblem] = []

    def check(row: tuple[str, str, str]) -> FileProblem | None:
        rel, hash_field, size = row
        path = installed_path(dist.site, rel)
        algo, _, expected = hash_field.partition("=")
        if algo != "sha256":
            return FileProblem(rel, "modified", f"unsupported RECORD hash {algo}")
        try:
            actual_size = path.stat().st_size
        except FileNotFoundError:
            return FileProblem(rel, "missing")
        if size and int(size) != actual_size:
            return FileProblem(rel, "modified", f"size {actual_size}, RECORD says {size}")
        if _record_digest(path) != expected:
            return FileProblem(rel, "modified", "sha256 differs from RECORD")
        return None

    with ThreadPoolExecutor(max_workers=workers) as pool:
        problems = [p for p in pool.map(check, checked) if p is not None]
    problems += _unexpected(dist, {p for p, _, _ in rows})
    return len(checked), problems


def top_folders(listed: set[str] | list[str]) -> list[str]:
    """The distribution's own top-level folders in site-packages, from RECORD's paths."""
    return sorted({p.split("/", 1)[0] for p in listed if "/" in p and not p.startswith("..")})


def _unexpected(dist: InstalledDist, listed: set[str]) -> list[FileProblem]:
    """Files inside the distribution's own folders that RECORD does not list."""
    stray = []
    for top in top_folders(listed):
        root = dist.site / top
        for dirpath, dirnames, filenames in os.walk(root):
            # Bytecode written after install is the interpreter's, not a change.
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for name in filenames:
                rel = (Path(dirpath) / name).relative_to(dist.site).as_posix()
                if rel not in listed:
                    stray.append(FileProblem(rel, "unexpected"))
    return stray


def read_manifest(dist: InstalledDist) -> BuildManifest | None:
    path = dist.site / dist.dist_info / MANIFEST_NAME
    if not path.is_file():
        return None
    return BuildManifest.from_json(json.loads(path.read_text(encoding="utf-8")))


class FixState(StrEnum):
    """What verify says of one fix. Strings underneath: text and JSON carry the values."""

    PRESENT = "present"
    PRESENT_UPSTREAM = "present (upstream form)"
    """The behaviour is there, not from our build (e.g. vLLM 0.22.0's offset fix)."""
    ABSENT = "absent"
    ABSENT_SKIPPED = "absent (skipped in build)"
    UNKNOWN = "unknown"
    NOT_NEEDED = "not needed on this base"
    """The ledger says the defect's code path is gone from the installed release
    (``[patch.on."BASE"]`` not-needed): nothing of the fix is to be found there."""

    @property
    def present(self) -> bool:
        return self in (FixState.PRESENT, FixState.PRESENT_UPSTREAM)

    @property
    def satisfied(self) -> bool:
        """Whether a requirement of the fix holds: it is present, or not needed here."""
        return self.present or self is FixState.NOT_NEEDED


def fix_state(result: ProbeResult, patch_id: str, manifest: BuildManifest | None) -> FixState:
    """The fix's state from its probe's answer and our manifest (pure)."""
    if result.status == PRESENT:
        ours = manifest is not None and patch_id in manifest.applied_patch_ids()
        return FixState.PRESENT if ours else FixState.PRESENT_UPSTREAM
    if result.status == ABSENT:
        skipped = manifest is not None and patch_id in manifest.skipped
        return FixState.ABSENT_SKIPPED if skipped else FixState.ABSENT
    return FixState.UNKNOWN


def base_release(version: str) -> str:
    """The upstream release an installed vLLM's version names: ours carry a local label
    (``0.34.0+dflash.22.<digest>``), stock none."""
    return version.split("+", 1)[0]


def fix_status(
    fix: Fix, result: ProbeResult, manifest: BuildManifest | None, base: str
) -> FixStatus:
    """One fix on the installed release ``base`` (pure). Where the ledger says the fix is not
    needed on that base, that is its state, and the probe's reading stays in the evidence."""
    code = fix.on.get(base)
    if code is not None and code.state is CodeState.NOT_NEEDED:
        why = " ".join(code.why.split())
        evidence = f"{why} (probe: {result.status}: {result.evidence})"
        return FixStatus(fix.number, fix.patch_id, fix.probe, FixState.NOT_NEEDED, evidence)
    state = fix_state(result, fix.patch_id, manifest)
    return FixStatus(fix.number, fix.patch_id, fix.probe, state, result.evidence, result.form)


def verify(
    dist: InstalledDist,
    probe_target: ProbeTarget,
    required: list[int],
    *,
    runtime_python: Path | None = None,
    log: Path | None = None,
    bytecode_cache: Path | None = None,
) -> VerifyReport:
    """Integrity and fixes of ``dist``; the probes import vLLM while the files are hashed.

    ``runtime_python``: the interpreter that runs the install, whose bytecode is
    checked (default: the probes' interpreter). ``bytecode_cache``: where the
    bytecode pairs found equal are kept (``verifying.bytecode``); None: all compiled.
    """
    known = registry()
    with start_probes(probe_target, known.probes, log=log) as run:
        files_checked, problems = check_files(dist)
        logger.debug("%d files of RECORD checked: %d problems", files_checked, len(problems))
        bytecode = check_bytecode(
            runtime_python or probe_target.python,
            dist.site,
            top_folders([p for p, _, _ in read_record(dist)]),
            bytecode_cache,
        )
        problems += [
            FileProblem(
                pyc,
                "bytecode",
                f"Python would run it for {source}, but it was compiled from other "
                f"code ({header} header)",
            )
            for pyc, source, header in bytecode.differ
        ]
        sources = {pyc: source for pyc, source, _ in bytecode.differ}
        manifest = read_manifest(dist)
        for problem in problems:
            owned = sources[problem.path] if problem.kind == "bytecode" else problem.path
            problem.patches = manifest.owners(owned) if manifest else []
        results = run.wait()
    base = base_release(dist.version)
    fixes = [fix_status(fix, results[fix.probe], manifest, base) for fix in known.fixes]
    identity = VersionIdentity(
        metadata=dist.version,
        runtime=run.vllm_version,
        stamped=manifest.runtime_version if manifest else None,
        built_by_us=manifest is not None,
    )
    return VerifyReport(
        dist, files_checked, problems, manifest, fixes, required, identity, bytecode, run.cached
    )


def install_into_fresh_env(
    wheel: Path, probe_python: Path, dest: Path, *, compile_bytecode: bool = True
) -> Path:
    """A new virtualenv at ``dest`` with ``wheel`` pip-installed (--no-deps); returns its python.

    The probes' imports (torch, transformers, ...) come from the probe
    environment through a .pth file, so the only thing installed is the wheel
    under test, by pip itself. ``compile_bytecode=False``: pip writes no ``.pyc``
    (what it would write is its own compiler's output, which says nothing about
    the wheel, and costs seconds to write and as many to check).
    """
    import venv

    # No pip inside: the toolchain's own pip installs into it (pip --python).
    try:
        venv.EnvBuilder(with_pip=False, clear=True).create(dest)
    except OSError as e:
        raise EnvironmentProblem(
            f"cannot create a virtualenv at {dest}: {e.strerror or e}"
        ) from None
    python = dest / "bin" / "python"
    logger.debug("a fresh virtualenv %s for %s", dest, wheel.name)
    where = f"cannot ask the probe interpreter {probe_python} for its site-packages"
    purelib = _ask(probe_python, _PURELIB, where, ProbeError).strip()
    where = f"cannot ask the new virtualenv's python {python} for its site-packages"
    own = _ask(python, _PURELIB, where, EnvironmentProblem).strip()
    (Path(own) / "dflash-probe-deps.pth").write_text(purelib + "\n")
    failure = pip_install(wheel, python=python, compile_bytecode=compile_bytecode)
    if failure is not None:
        raise VllmNotFoundError(f"pip could not install {wheel.name}: {failure}")
    return python


def _ask(python: Path, code: str, what: str, error: type[ToolingError]) -> str:
    """What ``python -c code`` prints; a failure is one ``error`` line starting with ``what``."""
    return procs.output([str(python), "-c", code], what=what, error=error, timeout_s=120)
