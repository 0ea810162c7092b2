"""``tooling bundle`` and the GPU host's ``make-parts.sh`` under hostile or careless input,
against package indexes served here (``tests/index_server.py``): real uv and pip, real
wheels, real signals. --offline touches no network; a pin is honoured exactly or refused;
part sizes are bounded before a part is written; every temp folder, pip's too, goes on any
exit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import BundleError, CacheMissError
from tooling.paths import REPO_DIR
from tooling.release.split import main as split_main

from .helpers import HANG_GUARD_S, wait_until
from .index_server import Index, Refusing, refusing_index, serving
from .wheels import build_wheel

#: The patched wheel stand-in: vLLM's name and version, two dependencies to resolve, and the
#: torch it pins, as vLLM's own wheels do.
VLLM = ("vllm", "0.20.1+dflash.12.abc", "sniffio\nRequires-Dist: six\nRequires-Dist: torch==2.11.0")


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    """An index's wheels: the torch vLLM pins, vLLM's dependencies in two versions
    each, and a project the bundle adds as an extra."""
    folder = tmp_path / "index"
    folder.mkdir()
    build_wheel(folder, "torch", "2.11.0")
    for version in ("1.3.0", "1.3.1"):
        build_wheel(folder, "sniffio", version, payload=200_000)
    for version in ("1.16.0", "1.17.0"):
        build_wheel(folder, "six", version)
    for version in ("2.0", "3.0"):
        build_wheel(folder, "extra_pkg", version)
    return folder


@pytest.fixture
def index(wheels: Path) -> Iterator[Index]:
    with serving(Index(wheels)) as served:
        yield served


def _vllm(tmp_path: Path) -> Path:
    folder = tmp_path / "dist"
    folder.mkdir(exist_ok=True)
    return build_wheel(folder, *VLLM)


def _environ(tmp_path: Path, **more: str) -> dict[str, str]:
    """The run's own caches (the toolchain's and uv's) and temp folder, nothing of pip.conf."""
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    return {
        **os.environ,
        "VLLM_DFLASH_CACHE": str(tmp_path / "cache"),
        "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
        "TMPDIR": str(scratch),
        **more,
    }


def _bundle(
    tmp_path: Path, *args: str, index_url: str, offline: bool = False, **env: str
) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "tooling", "--no-progress", "--index-url", index_url]
    command += ["--offline"] if offline else []
    command += ["bundle", "--wheel", str(_vllm(tmp_path)), "--out", str(tmp_path / "out"), *args]
    return subprocess.Popen(
        command,
        env=_environ(tmp_path, **env),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    return proc.returncode, out, err


def _empty(folder: Path) -> bool:
    """Nothing there: the folder absent, or empty."""
    return not folder.exists() or not any(folder.iterdir())


def _shipped(tmp_path: Path) -> list[str]:
    (bundle,) = [p for p in (tmp_path / "out").iterdir() if not p.name.endswith("-parts")]
    return sorted(p.name for p in (bundle / "wheels").iterdir())


@pytest.mark.slow
def test_offline_bundle_touches_no_network(tmp_path: Path) -> None:
    """It resolved against the index anyway, and failed on "Connection refused"."""
    with refusing_index() as refusing:
        code, _, err = _finish(
            _bundle(tmp_path, "--extra", "six==1.17.0", index_url=refusing.url, offline=True)
        )
    assert refusing.connections == 0
    assert code == CacheMissError.exit_code, err
    assert err.startswith("error: --offline: uv could not resolve ") and err.count("\n") == 1
    assert _empty(tmp_path / "out")


@pytest.mark.slow
def test_offline_bundle_is_made_from_what_an_earlier_run_kept(tmp_path: Path, index: Index) -> None:
    code, _, err = _finish(_bundle(tmp_path, "--extra", "extra-pkg==2.0", index_url=index.url))
    assert code == 0, err
    online = _shipped(tmp_path)
    for path in (tmp_path / "out").iterdir():
        subprocess.run(["rm", "-r", str(path)], check=True)
    asked = len(index.requests)
    # The same index (uv keeps its answers by the index's URL), every proxy pointed at a
    # port that counts connections: neither may be asked.
    with refusing_index() as refusing:
        proxies = {k: v for k, v in refusing.environ().items() if "INDEX" not in k}
        proc = _bundle(
            tmp_path, "--extra", "extra-pkg==2.0", index_url=index.url, offline=True, **proxies
        )
        code, _, err = _finish(proc)
    assert (code, refusing.connections, index.requests[asked:]) == (0, 0, []), err
    assert _shipped(tmp_path) == online


@pytest.mark.slow
def test_an_extra_pinned_against_the_resolution_is_refused(tmp_path: Path, index: Index) -> None:
    """six==1.16.0 shipped six-1.17.0, the pin dropped without a word."""
    code, _, err = _finish(_bundle(tmp_path, "--extra", "six==1.16.0", index_url=index.url))
    assert (code, err) == (
        BundleError.exit_code,
        "error: --extra six==1.16.0: the resolution needs six 1.17.0, and a bundle carries one "
        "version of a package (pin 1.17.0, or leave six out of --extra)\n",
    )
    assert _empty(tmp_path / "out")


@pytest.mark.slow
def test_a_pin_is_honoured_exactly(tmp_path: Path, index: Index) -> None:
    """The extra's older version though a newer is on the index; the resolution's own
    version pinned in another spelling."""
    code, _, err = _finish(
        _bundle(tmp_path, "--extra", "Extra_Pkg==2.0", "--extra", "SIX==1.17", index_url=index.url)
    )
    assert code == 0, err
    assert _shipped(tmp_path) == [
        "extra_pkg-2.0-py3-none-any.whl",
        "six-1.17.0-py3-none-any.whl",
        "sniffio-1.3.1-py3-none-any.whl",
        "torch-2.11.0-py3-none-any.whl",
        f"vllm-{VLLM[1]}-py3-none-any.whl",
    ]


@pytest.mark.parametrize(
    "extra",
    [
        "===",
        "==1.0",
        "six",
        "six>=1.0",
        "six==1.*",
        "six~=1.16",
        "six==1.16,<2",
        "six[tests]==1.17.0",
        "six==1.17.0; python_version < '3'",
        "six @ https://example.com/six-1.17.0-py3-none-any.whl",
        "six==not-a-version",
    ],
)
def test_an_extra_that_is_not_one_exact_version_is_refused_before_any_network(
    tmp_path: Path, extra: str
) -> None:
    """``===`` printed pip's whole command line; each is refused before uv runs."""
    with refusing_index() as refusing:
        result = _bundle_here(tmp_path, refusing, "--extra", extra)
    assert refusing.connections == 0
    assert (result.exit_code, result.stderr) == (
        BundleError.exit_code,
        f"error: --extra {extra!r}: give it as name==version (one exact version)\n",
    )
    assert result.stdout == ""


def test_an_extra_pinned_twice_is_refused(tmp_path: Path) -> None:
    with refusing_index() as refusing:
        result = _bundle_here(tmp_path, refusing, "--extra", "six==1.16.0", "--extra", "six==1.17")
    assert (result.exit_code, result.stderr) == (
        BundleError.exit_code,
        "error: --extra six: pinned twice, to 1.16.0 and 1.17\n",
    )
    assert refusing.connections == 0


def test_an_exclude_present_list_that_never_ends_is_refused_after_its_bound(
    tmp_path: Path,
) -> None:
    with refusing_index() as refusing:
        result = _bundle_here(tmp_path, refusing, "--exclude-present", "/dev/zero")
    assert (result.exit_code, result.stderr) == (
        BundleError.exit_code,
        "error: /dev/zero: over 16777216 bytes: not the exclude-present list\n",
    )
    assert refusing.connections == 0


def _bundle_here(tmp_path: Path, refusing: Refusing, *args: str) -> Any:
    """``tooling bundle`` in this process (a refusal before any child), the index and every
    proxy pointed at ``refusing``."""
    command = ["--no-progress", "--index-url", refusing.url, "bundle"]
    command += ["--wheel", str(_vllm(tmp_path)), "--out", str(tmp_path / "out"), *args]
    env = {**refusing.environ(), "VLLM_DFLASH_CACHE": str(tmp_path / "cache")}
    return CliRunner(env=env).invoke(main, command)


@pytest.mark.slow
@pytest.mark.parametrize("size", ["1", "100"])
def test_a_split_into_too_many_parts_is_refused_before_anything_is_written(
    tmp_path: Path, index: Index, size: str
) -> None:
    """--split 1 wrote 671,604 one-byte parts (5.7 GB) in 90 s."""
    code, _, err = _finish(
        _bundle(tmp_path, "--extra", "six==1.17.0", "--split", size, index_url=index.url)
    )
    assert code == BundleError.exit_code, err
    assert err.startswith("error: --split: ") and f"in parts of {size} would be " in err
    assert "more than 10000: give a part size of at least " in err and err.count("\n") == 1
    assert _empty(tmp_path / "out")


@pytest.mark.slow
def test_a_bundle_stopped_while_pip_downloads_leaves_no_temp_folder(
    tmp_path: Path, index: Index
) -> None:
    """pip's build tracker, download and unpack folders stayed in $TMPDIR."""
    index.stall.add("sniffio")
    proc = _bundle(tmp_path, "--extra", "six==1.17.0", index_url=index.url)
    scratch = tmp_path / "tmp"
    wait_until(
        lambda: any(scratch.glob("dflash-bundle-*/pip-unpack-*")), "pip downloading", alive=proc
    )
    proc.send_signal(signal.SIGTERM)
    code, _, err = _finish(proc)
    assert (code, err) == (143, "error: interrupted (SIGTERM)\n")
    assert list(scratch.iterdir()) == []
    assert _empty(tmp_path / "out")


def test_splitting_into_a_folder_that_holds_files_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was an unexpected OSError (the staged parts renamed onto a folder not empty)."""
    bundle, parts = tmp_path / "bundle", tmp_path / "parts"
    bundle.mkdir()
    (bundle / "a.bin").write_bytes(os.urandom(4096))
    parts.mkdir()
    (parts / "mine.txt").write_text("keep")
    code = split_main([str(bundle), str(parts), "1024"])
    assert (code, capsys.readouterr().err) == (
        BundleError.exit_code,
        f"error: {parts} exists and is not an empty folder: give a new one\n",
    )
    assert [p.name for p in parts.iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "parts"]


def test_a_split_that_would_pass_the_part_count_is_refused_before_a_part_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "a.bin").write_bytes(os.urandom(100_000))
    code = split_main([str(bundle), str(tmp_path / "p"), "1"])
    err = capsys.readouterr().err
    assert code == BundleError.exit_code
    assert err.startswith(f"error: splitting {bundle}: ") and "more than 10000" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def _processes_naming(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(text.encode() in w for w in words):
            found.append(b" ".join(words).decode(errors="replace"))
    return found


@pytest.mark.slow
def test_make_parts_stopped_while_pip_downloads_leaves_nothing_running_or_behind(
    tmp_path: Path, index: Index
) -> None:
    """SIGTERM to the script alone (as a CI cancel or `timeout` sends it): its bundle step
    is stopped, and its temp folder (the children's TMPDIR) goes, pip's folders in it."""
    cache = tmp_path / "cache"
    (cache / "pypi").mkdir(parents=True)
    name, _, requires = VLLM
    wheel = build_wheel(cache / "pypi", name, "0.20.1", requires)
    assert zipfile.is_zipfile(wheel)
    # make-parts asks for the release's sdist before it resolves anything.
    (cache / "pypi" / "vllm-0.20.1.tar.gz").write_bytes(b"not read before the bundle")
    index.stall.add("sniffio")
    scratch = tmp_path / "tmp"
    script = subprocess.Popen(
        ["bash", str(REPO_DIR / "ci" / "gpu" / "make-parts.sh"), str(tmp_path / "parts")],
        env=_environ(tmp_path, TOOLING_INDEX_URL=index.url, TRAINING="0"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(
        lambda: any(scratch.glob("*/tmp/dflash-bundle-*/pip-unpack-*")),
        "pip downloading",
        alive=script,
    )
    script.send_signal(signal.SIGTERM)
    code, _, err = _finish(script)
    assert code == 143, err
    assert list(scratch.iterdir()) == []
    assert not (tmp_path / "parts").exists()
    wait_until(lambda: not _processes_naming(str(scratch)), "the bundle step stopping")


@pytest.mark.slow
def test_the_staging_folders_of_a_bundle_killed_outright_go_with_the_next(
    tmp_path: Path, index: Index
) -> None:
    """A bundle killed (SIGKILL) while it wrote or split left its staging folders for good:
    the next run of the same bundle removes them, under the folder's lock."""
    name = f"vllm-{VLLM[1]}-bundle-cp312-manylinux_2_35_x86_64"
    out = tmp_path / "out"
    for left in (f".{name}.k1ll3d00.part", f".{name}-parts.k1ll3d00.part"):
        (out / left).mkdir(parents=True)
        (out / left / "half.bin").write_bytes(b"\0" * 1000)
    code, _, err = _finish(
        _bundle(tmp_path, "--extra", "six==1.17.0", "--split", "64K", index_url=index.url)
    )
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [name, f"{name}-parts"]


def test_a_base_whose_wheel_pins_what_the_index_lost_resolves_without_it(
    tmp_path: Path, index: Index
) -> None:
    """0.34.0's wheel pins flashinfer-python==0.7.3, which PyPI no longer lists: resolved as
    pinned, its closure has no solution (exit 19, uv's reason named). Its ``bundle_excludes``
    in bases.toml leave such packages out of the resolution, and the plan says so."""
    (tmp_path / "dist").mkdir()
    gone = build_wheel(
        tmp_path / "dist", "vllm", "0.34.0", "sniffio\nRequires-Dist: gone-pkg==0.7.3"
    )
    bases = tmp_path / "patches"
    shutil.copytree(REPO_DIR / "patches", bases)
    text = (bases / "bases.toml").read_text()
    command = [
        sys.executable, "-m", "tooling", "--no-progress", "--index-url", index.url,
        "--patches-dir", str(bases), "bundle", "--base", "0.34.0", "--wheel", str(gone),
        "--out", str(tmp_path / "out"), "--lock-only", str(tmp_path / "lock.txt"), "--json",
    ]  # fmt: skip
    refused = subprocess.run(command, env=_environ(tmp_path), capture_output=True, text=True)
    assert refused.returncode == 19, refused.stderr
    assert "gone-pkg==0.7.3" in refused.stderr and len(refused.stderr.splitlines()) == 1
    (bases / "bases.toml").write_text(text.replace('"flashinfer-python",', '"gone-pkg",'))
    done = subprocess.run(command, env=_environ(tmp_path), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)["plan"]
    assert [e["name"] for e in plan["include"] if e["source"] == "resolved"] == ["sniffio"]
    assert ["gone-pkg", "", "not resolved (the base's bundle_excludes)"] in plan["skipped"]
    assert "gone-pkg" not in (tmp_path / "lock.txt").read_text()
