"""``tooling bundle`` on the way to a host: a bundle of locally built wheels is written,
split, joined by its own ``join.py`` and installed by its own ``install.sh`` (offline), and a
small one is resolved by uv and downloaded by pip (network), so what reaches the host is whole.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tooling.errors import BundleError
from tooling.paths import REPO_DIR
from tooling.release.bundle import write_bundle
from tooling.release.bundle_plan import BundleConfig, parse_present, plan_bundle
from tooling.release.download import download as download_wheels
from tooling.release.download import resolve
from tooling.release.lock import Requirement
from tooling.release.split import split_bundle

from .wheels import build_wheel


@pytest.fixture(scope="module")
def local_bundle(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("local-bundle")
    patched = build_wheel(root, "vllm_standin", "0.20.1+dflash", "helper-dep", payload=60_000)
    helper = build_wheel(root, "helper_dep", "1.2.3", payload=30_000)
    plan = plan_bundle(
        [
            Requirement(
                "helper-dep",
                "1.2.3",
                hashes=(hashlib.sha256(helper.read_bytes()).hexdigest(),),
                via=("vllm-standin",),
            )
        ],
        wheel=patched,
        extras=(),
    )
    config = BundleConfig(
        wheel=patched,
        out_dir=root / "out",
        exclude_newer="2026-05-06",
        split_bytes=20_000,
        progress=False,
    )
    result = write_bundle(plan, {"helper-dep": helper}, config)
    return {"root": root, "config": config, "result": result}


def test_bundle_contents_and_sums(local_bundle) -> None:
    result = local_bundle["result"]
    bundle = result.bundle_dir
    assert bundle.name == "vllm-standin-0.20.1+dflash-bundle-cp312-manylinux_2_35_x86_64"
    assert sorted(p.name for p in (bundle / "wheels").iterdir()) == [
        "helper_dep-1.2.3-py3-none-any.whl",
        "vllm_standin-0.20.1+dflash-py3-none-any.whl",
    ]
    install = (bundle / "install.txt").read_text().splitlines()
    assert [line.split(" ")[0] for line in install] == [
        "helper-dep==1.2.3",
        "vllm-standin==0.20.1+dflash",
    ]
    assert all("--hash=sha256:" in line for line in install)
    sums = dict(line.split("  ")[::-1] for line in (bundle / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {f.path for f in result.files}
    for rel, digest in sums.items():
        assert hashlib.sha256((bundle / rel).read_bytes()).hexdigest() == digest
    # Nothing half-written left beside the results.
    assert not [p for p in bundle.parent.iterdir() if p.name.startswith(".")]


def test_a_wheel_that_differs_from_the_lock_is_refused(tmp_path: Path) -> None:
    patched = build_wheel(tmp_path, "vllm_standin", "0.1")
    helper = build_wheel(tmp_path, "helper_dep", "1.0")
    plan = plan_bundle(
        [Requirement("helper-dep", "1.0", hashes=("0" * 64,), via=("-r",))],
        wheel=patched,
        extras=(),
    )
    config = BundleConfig(
        wheel=patched, out_dir=tmp_path / "out", exclude_newer="2026-05-06", progress=False
    )
    with pytest.raises(BundleError, match="none of the index's"):
        write_bundle(plan, {"helper-dep": helper}, config)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_parts_respect_the_size_limit(local_bundle) -> None:
    result = local_bundle["result"]
    limit = local_bundle["config"].split_bytes
    assert len(result.parts) >= 4
    assert all(p.size == limit for p in result.parts[:-1])
    assert 0 < result.parts[-1].size <= limit
    for part in result.parts:
        assert (
            hashlib.sha256((result.parts_dir / part.path).read_bytes()).hexdigest() == part.sha256
        )
    assert {p.name for p in result.parts_dir.iterdir()} == {
        *(p.path for p in result.parts),
        "SHA256SUMS",
        "join.py",
    }


def _join(parts_dir: Path, dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(parts_dir / "join.py"), str(dest)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_join_and_install_offline(local_bundle, tmp_path: Path) -> None:
    result = local_bundle["result"]
    joined = _join(result.parts_dir, tmp_path / "host")
    assert joined.returncode == 0, joined.stderr
    bundle = tmp_path / "host" / result.bundle_dir.name
    assert "install: sh " in joined.stdout
    for original in result.files:
        assert (bundle / original.path).read_bytes() == (
            result.bundle_dir / original.path
        ).read_bytes()
    assert not list((tmp_path / "host").glob("*.tar*"))  # the joined archive is removed
    if shutil.which("sha256sum"):
        check = subprocess.run(
            ["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=bundle, capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr
    site = tmp_path / "site"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["sh", str(bundle / "install.sh"), "--target", str(site)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"export PYTHONPATH={site}" in done.stdout
    code = "import helper_dep, vllm_standin as v; print(v.VERSION, helper_dep.VERSION)"
    ran = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert ran.stdout.split() == ["0.20.1+dflash", "1.2.3"], ran.stderr


def _bundle_leaving_out(root: Path, name: str, version: str, host_has: str) -> Path:
    """A bundle of a stand-in wheel that needs ``name==version``, made with ``host_has`` as
    the --exclude-present list (so ``name`` is left out as the host's)."""
    patched = build_wheel(root, "vllm_standin", "0.34.0+dflash", name)
    plan = plan_bundle(
        [Requirement(name, version, hashes=(), via=("vllm-standin",))],
        wheel=patched,
        present=parse_present(host_has),
        extras=(),
    )
    assert plan.present == ((name, version),)
    config = BundleConfig(
        wheel=patched, out_dir=root / "out", exclude_newer="2026-11-17", progress=False
    )
    return write_bundle(plan, {}, config).bundle_dir


def test_install_refuses_a_host_without_what_the_bundle_left_out(tmp_path: Path) -> None:
    """A bare name in --exclude-present matches any version while the bundle is made; the
    host must have the version the closure was resolved with (0.34.0 pins torch 2.14.0, an
    H200 host has 2.11.0). install.sh checks before it installs: one line, exit 3, and the
    target is not made."""
    bundle = _bundle_leaving_out(tmp_path, "helper-dep", "9.9.9", "helper-dep\n")
    assert (bundle / "present.txt").read_text() == "helper-dep==9.9.9\n"
    site = tmp_path / "site"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["sh", str(bundle / "install.sh"), "--target", str(site)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip().splitlines() == [
        "install.sh: this host has no helper-dep, but the bundle was resolved with "
        "helper-dep==9.9.9 and left it out as the host's (--exclude-present): make the bundle "
        "again from the host's `pip freeze`, or without that name; nothing was installed"
    ]
    assert not site.exists()


def test_install_goes_on_where_the_host_has_what_was_left_out(tmp_path: Path) -> None:
    """This interpreter's own pip, left out as the host's at its version (a local label
    aside), passes the check, and the rest installs."""
    from importlib.metadata import version

    pip = version("pip")
    bundle = _bundle_leaving_out(tmp_path, "pip", pip, f"pip=={pip}+local\n")
    site = tmp_path / "site"
    done = subprocess.run(
        ["sh", str(bundle / "install.sh"), "--target", str(site)],
        env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (site / "vllm_standin").is_dir()


def test_install_script_refuses_unknown_options(local_bundle) -> None:
    script = local_bundle["result"].bundle_dir / "install.sh"
    bad = subprocess.run(["sh", str(script), "--tagret", "x"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "unknown option --tagret" in bad.stderr


def test_join_names_a_corrupt_or_missing_part(local_bundle, tmp_path: Path) -> None:
    parts = tmp_path / "parts"
    shutil.copytree(local_bundle["result"].parts_dir, parts)
    second = sorted(parts.glob("*.part-*"))[1]
    data = bytearray(second.read_bytes())
    data[100] ^= 0xFF
    second.write_bytes(bytes(data))
    broken = _join(parts, tmp_path / "dest")
    assert broken.returncode == 1
    assert f"{second.name} is corrupt" in broken.stderr
    assert not (tmp_path / "dest").exists()
    second.unlink()
    missing = _join(parts, tmp_path / "dest")
    assert missing.returncode == 1
    assert f"{second.name} is missing" in missing.stderr


def test_join_takes_a_thousand_parts_and_more_in_their_order(tmp_path: Path) -> None:
    """Part names carry three digits at least: part-1000 sorts before part-101 by name,
    so the join must follow the numbers."""
    bundle = tmp_path / "b"
    bundle.mkdir()
    payload = os.urandom(24_000)
    (bundle / "data.bin").write_bytes(payload)
    parts_dir, parts = split_bundle(bundle, tmp_path / "parts", 24, show_progress=False)
    assert len(parts) > 1000
    joined = _join(parts_dir, tmp_path / "dest")
    assert joined.returncode == 0, joined.stderr
    assert (tmp_path / "dest" / "b" / "data.bin").read_bytes() == payload


@pytest.mark.slow
def test_resolve_download_and_write_a_small_bundle(tmp_path: Path) -> None:
    """uv resolves a wheel's dependencies, pip downloads them hash-checked (network)."""
    wheel = build_wheel(tmp_path, "vllm_standin", "0.20.1+dflash", "sniffio")
    config = BundleConfig(
        wheel=wheel,
        out_dir=tmp_path / "out",
        exclude_newer="2026-05-06",
        pins=("distro==1.9.0",),
        extras=("six==1.17.0",),
        skip=(),
        progress=False,
    )
    try:
        resolution = resolve(config)
        plan = plan_bundle(resolution.requirements, wheel=wheel, skip=(), extras=config.extras)
        wheels = download_wheels(plan, config, tmp_path / "downloads")
    except BundleError as e:
        pytest.skip(f"no package index reachable: {e}")
    assert {(r.name, r.version) for r in resolution.requirements} == {
        ("distro", "1.9.0"),
        ("sniffio", "1.3.1"),
        ("vllm-standin", "0.20.1+dflash"),
    }
    assert all(r.hashes for r in resolution.requirements)
    result = write_bundle(plan, wheels, config, resolution)
    names = sorted(p.name for p in (result.bundle_dir / "wheels").iterdir())
    assert names == [
        "distro-1.9.0-py3-none-any.whl",
        "six-1.17.0-py2.py3-none-any.whl",
        "sniffio-1.3.1-py3-none-any.whl",
        "vllm_standin-0.20.1+dflash-py3-none-any.whl",
    ]
    lock = (result.bundle_dir / "requirements.lock").read_text()
    assert "--exclude-newer 2026-05-06" in lock and "sniffio==1.3.1" in lock
    assert f"./wheels/{wheel.name}" in lock and str(tmp_path) not in lock


def test_the_carried_scripts_are_files_that_pass_their_linters(tmp_path) -> None:
    files = REPO_DIR / "tooling" / "release" / "bundle_files"
    shellcheck = Path(sys.executable).parent / "shellcheck"
    result = subprocess.run(
        [str(shellcheck), str(files / "install.sh")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout
    ruff = Path(sys.executable).parent / "ruff"
    result = subprocess.run([str(ruff), "check", str(files / "join.py")], capture_output=True)
    assert result.returncode == 0, result.stdout
    # install.sh answers --help from its own header, as a file run by sh.
    result = subprocess.run(["sh", str(files / "install.sh"), "--help"], capture_output=True)
    assert result.returncode == 0 and b"--target DIR" in result.stdout
