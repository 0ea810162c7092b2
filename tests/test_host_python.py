"""The GPU host's scripts under an interpreter that has only what the host's python3 has
before the bundle is installed: the standard library and the packages of the host's image
(``ci/gpu/h200-image-packages.txt``) that this machine has too. No GitPython, gitdb or smmap
(the bundle brings them), no uv: ``tooling host`` must join, install and run a session with
none of them."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tooling.paths import REPO_DIR
from tooling.release.split import split_bundle

from .helpers import HANG_GUARD_S
from .wheels import build_wheel

IMAGE = REPO_DIR / "ci" / "gpu" / "h200-image-packages.txt"


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-")


def host_only_python(folder: Path) -> Path:
    """A ``python3`` (in ``folder/bin``) that is this interpreter without its site-packages
    (``-S``), with a folder of links to the image's packages that this environment has
    after whatever PYTHONPATH it is given, as the host's site-packages come after it."""
    image = {
        _canonical(line.strip())
        for line in IMAGE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    site = folder / "image-site"
    site.mkdir(parents=True)
    for dist in importlib.metadata.distributions():
        if _canonical(dist.metadata["Name"]) not in image:
            continue
        tops = {f.parts[0] for f in dist.files or () if f.parts[0] not in ("..", "__pycache__")}
        for top in sorted(t for t in tops if not t.endswith((".dist-info", ".pth"))):
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    python = folder / "bin" / "python3"
    python.parent.mkdir()
    python.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site}" exec {sys.executable} -S "$@"\n'
    )
    python.chmod(0o755)
    return python


def _run(
    python: Path, script: str, *args: str, work: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(REPO_DIR / "ci" / "gpu" / script), *args],
        env={
            "PATH": f"{python.parent}:/usr/bin:/bin",
            "HOME": os.environ.get("HOME", "/root"),
            "WORK": str(work),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    made = host_only_python(tmp_path_factory.mktemp("host-python"))
    for module in ("git", "gitdb", "smmap"):
        missing = subprocess.run(
            [str(made), "-c", f"import {module}"], capture_output=True, text=True, timeout=60
        )
        assert missing.returncode != 0, f"the host's python3 must lack {module}"
    return made


def _parts(tmp_path: Path, release: str = "vllm-0.20.1") -> Path:
    """Parts as make-parts.sh makes them: a bundle of one small wheel, its install.sh, and
    the vLLM sdist's name (``release``'s)."""
    payload = tmp_path / "payload"
    wheels = payload / "bundle" / "wheels"
    wheels.mkdir(parents=True)
    wheel = build_wheel(wheels, "hostpkg", "1.0")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (payload / "bundle" / "install.txt").write_text(f"hostpkg==1.0 --hash=sha256:{digest}\n")
    install = REPO_DIR / "tooling" / "release" / "bundle_files" / "install.sh"
    (payload / "bundle" / "install.sh").write_text(install.read_text())
    (payload / f"{release}.tar.gz").write_bytes(b"not built here")
    parts, _ = split_bundle(payload, tmp_path / "parts", 1 << 20, show_progress=False)
    return parts


def test_setup_joins_and_installs_with_only_what_the_host_has(python: Path, tmp_path: Path) -> None:
    parts, work = _parts(tmp_path), tmp_path / "work"
    done = _run(python, "host-setup.sh", str(parts), "install", work=work)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (work / "site" / "hostpkg" / "__init__.py").is_file()
    assert (work / "joined" / "payload" / "vllm-0.20.1.tar.gz").is_file()
    assert "Traceback" not in done.stderr


def test_a_session_starts_runs_and_is_waited_for_with_only_what_the_host_has(
    python: Path, tmp_path: Path
) -> None:
    """``start`` installs and starts the session; the session's build needs the official
    wheel, which these parts lack: it fails, says so in its log, and ends; ``wait`` sees it
    end and collects."""
    parts, work, out = _parts(tmp_path), tmp_path / "work", tmp_path / "out"
    out.mkdir()
    started = _run(python, "hybrid-session.sh", "start", str(parts), "tiny", work=work)
    assert started.returncode == 0, started.stdout + started.stderr
    assert started.stdout.splitlines()[-1].startswith("session started (pid ")
    deadline = time.monotonic() + HANG_GUARD_S
    done = None
    while time.monotonic() < deadline:
        done = _run(python, "hybrid-session.sh", "wait", "5", work=work, OUT=str(out))
        if done.stdout.endswith("session: ended\n"):
            break
    assert done is not None and done.returncode == 0, done.stderr
    assert done.stdout.endswith("session: ended\n")
    assert "build failed" in done.stdout
    assert "hostpkg-1.0-py3-none-any.whl" not in done.stdout
    build = (work / "session" / "build.log").read_text()
    assert "vllm-0.20.1-*.whl, expected one" in build and "Traceback" not in build
    assert {p.name for p in out.iterdir()} >= {"collect.txt", "texts.txt", "reports.tgz"}
    # The host's packages with versions come back, for a bundle's --exclude-present.
    freeze = (work / "session" / "host-freeze.txt").read_text()
    assert re.search(r"^[A-Za-z0-9_.-]+==\d", freeze, re.M), freeze[:300]
    assert "== session/host-freeze.txt" in (out / "texts.txt").read_text()


def test_the_parts_name_the_release_every_build_is_for(python: Path, tmp_path: Path) -> None:
    """Parts of another pinned release (make-parts.sh BASE=0.34.0): setup installs them and
    builds for that release, asking for its official wheel; a payload of two sdists names
    no one release and is refused before anything is built."""
    parts, work = _parts(tmp_path, "vllm-0.34.0"), tmp_path / "work"
    done = _run(python, "host-setup.sh", str(parts), work=work, ABLATIONS="", PROBES="0")
    assert done.returncode != 0
    assert "vllm-0.34.0-*.whl, expected one" in done.stderr, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    (work / "joined" / "payload" / "vllm-0.20.1.tar.gz").write_bytes(b"a second release")
    again = _run(python, "host-setup.sh", str(parts), "build", work=work, ABLATIONS="")
    assert again.returncode != 0
    assert "one vllm-VERSION.tar.gz" in again.stderr and "Traceback" not in again.stderr
