"""Precompiled build: byte-identical kernels, valid RECORD, identity, manifest, refusals."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import git
import pytest
from wheel.wheelfile import WheelFile

from tooling.building.build import BuildOptions, build_precompiled
from tooling.building.identity import (
    VERSION_FILE,
    VERSION_STAMP,
    plan_identity,
    rewrite_wheel_file,
    runtime_version,
    stamp_version,
)
from tooling.building.manifest import MANIFEST_NAME, BuildManifest
from tooling.building.sbom import SBOM_NAME
from tooling.errors import BuildError, IntegrityError
from tooling.patching import worktree
from tooling.patching.apply import apply_series

from .helpers import apply_options, touched_upstream

OFFICIAL = "vllm-0.20.1-1-cp38-abi3-manylinux_2_35_x86_64.whl"


@pytest.fixture(scope="module")
def touched(series) -> set[str]:
    """Every member a build replaces: the series' files and the stamped version module."""
    return {f for p in series.patches for f in p.files} | {VERSION_FILE}


def load_version_module(text: str) -> dict:
    namespace: dict = {}
    exec(compile(text, VERSION_FILE, "exec"), namespace)
    return namespace


def raw(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    with open(zf.filename, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (
            int.from_bytes(f.read(2), "little"),
            int.from_bytes(f.read(2), "little"),
        )
        f.seek(info.header_offset + 30 + name_len + extra_len)
        return f.read(info.compress_size)


@pytest.mark.slow
def test_identity_keeps_platform_and_build_tag(built_wheel, series):
    label = f"0.20.1+dflash.{len(series.patches)}.{series.digest[:8]}"
    assert built_wheel.version == label
    assert built_wheel.filename == f"vllm-{label}-1-cp38-abi3-manylinux_2_35_x86_64.whl"
    with zipfile.ZipFile(built_wheel.path) as zf:
        wheel_file = zf.read(f"vllm-{label}.dist-info/WHEEL").decode()
        metadata = zf.read(f"vllm-{label}.dist-info/METADATA").decode()
    assert "Tag: cp38-abi3-manylinux_2_35_x86_64" in wheel_file.splitlines()
    assert "Build: 1" in wheel_file.splitlines()
    assert f"Version: {label}" in metadata.splitlines()


@pytest.mark.slow
def test_unchanged_members_are_the_official_bytes(built_wheel, upstream_0201, touched):
    with zipfile.ZipFile(upstream_0201.wheel) as off, zipfile.ZipFile(built_wheel.path) as out:
        ours = {i.filename: i for i in out.infolist()}
        copied = 0
        for info in off.infolist():
            if info.filename in touched or ".dist-info/" in info.filename:
                continue
            mine = ours[info.filename]
            assert (mine.CRC, mine.compress_size, mine.compress_type) == (
                info.CRC,
                info.compress_size,
                info.compress_type,
            ), info.filename
            if info.file_size > 10_000_000:  # the kernels: compare the stored bytes themselves
                assert raw(out, mine) == raw(off, info), info.filename
            copied += 1
        official = {i.filename for i in off.infolist()}
        assert copied == len(official) - len(touched & official) - 6
        # A module the series adds is shipped too (patch 32's kernels).
        assert touched - official - {VERSION_FILE} <= set(ours)
        big = [i.filename for i in off.infolist() if i.file_size > 70_000_000]
        assert "vllm/_C.abi3.so" in big


@pytest.mark.slow
def test_record_is_valid_and_patched_files_are_the_work_tree_heads(
    built_wheel, patched_0201, touched
):
    repo = git.Repo(patched_0201.work_dir)
    with WheelFile(built_wheel.path) as wf:  # the `wheel` project's own RECORD check
        for info in wf.infolist():
            data = wf.read(info.filename)  # raises WheelError on a hash mismatch
            if info.filename in touched - {VERSION_FILE}:
                assert data == worktree.read_blob(repo, "HEAD", info.filename)


@pytest.mark.slow
def test_manifest_and_sbom(built_wheel, upstream_0201, series, touched):
    with zipfile.ZipFile(built_wheel.path) as zf:
        info = f"vllm-{built_wheel.version}.dist-info"
        manifest = BuildManifest.from_json(json.loads(zf.read(f"{info}/{MANIFEST_NAME}")))
        sbom = json.loads(zf.read(f"{info}/sboms/{SBOM_NAME}"))
    assert manifest.base_version == "0.20.1" and manifest.mode == "precompiled"
    assert manifest.source_date_epoch == 1795910400
    assert {a["kind"]: a["sha256"] for a in manifest.upstream} == {
        "sdist": upstream_0201.base.sdist.sha256,
        "wheel": upstream_0201.base.wheel.sha256,
    }
    assert [(p.id, p.status, p.probe_before, p.probe_after) for p in manifest.patches] == [
        (p.id, "applied", "absent", "present") for p in series.patches
    ]
    # SPDX needs each patch file's SHA1 (tests/test_sbom.py validates the document itself).
    assert [p.sha1 for p in manifest.patches] == [
        hashlib.sha1(p.file.read_bytes()).hexdigest() for p in series.patches
    ]
    assert {f.path for f in manifest.files} == touched
    assert manifest.owners(VERSION_FILE) == [VERSION_STAMP]
    assert manifest.owners("vllm/v1/core/sched/scheduler.py") == [
        "0003-eagle-cache-drop.patch",
        "0004-dflash-lookahead-slots.patch",
        "0013-mamba-chunk-liveness.patch",
        "0017-spec-tokens-by-batch.patch",
        "0033-join-hold.patch",
    ]
    for f in manifest.files:
        assert f.sha256_before != f.sha256_after
    assert sbom["spdxVersion"] == "SPDX-2.3"
    names = {p["name"] for p in sbom["packages"]}
    assert {"vllm", OFFICIAL} <= names
    patches = {f["fileName"] for f in sbom["files"]}
    assert patches == {f"./patches/{p.file.name}" for p in series.patches}
    applied = sum(r["relationshipType"] == "PATCH_APPLIED" for r in sbom["relationships"])
    assert applied == len(series.patches)


@pytest.mark.slow
def test_vllm_reports_the_stamped_version(built_wheel, upstream_0201):
    """vllm.__version__ (what vLLM keys compiled graphs and /version by) is the build's."""
    with zipfile.ZipFile(built_wheel.path) as zf, zipfile.ZipFile(upstream_0201.wheel) as off:
        info = f"vllm-{built_wheel.version}.dist-info"
        manifest = BuildManifest.from_json(json.loads(zf.read(f"{info}/{MANIFEST_NAME}")))
        ours = load_version_module(zf.read(VERSION_FILE).decode())
        stock = load_version_module(off.read(VERSION_FILE).decode())
    label = built_wheel.version.split("+", 1)[1]
    assert ours["__version__"] == manifest.runtime_version == built_wheel.version
    assert ours["__version_tuple__"] == (0, 20, 1, label)
    assert stock["__version__"] == "0.20.1" != ours["__version__"]
    # Everything else in the module is setuptools-scm's, e.g. the commit id.
    assert ours["__commit_id__"] == stock["__commit_id__"]


def test_stamp_refuses_a_version_module_it_does_not_know():
    with pytest.raises(BuildError, match="expected one line matching"):
        stamp_version("__version__ = '0.20.1'\n", "0.20.1+dflash.6.abc")


@pytest.mark.slow
def test_two_builds_are_byte_identical(tmp_path, built_wheel, upstream_0201, series, patched_0201):
    again = build_precompiled(
        upstream_0201,
        series,
        patched_0201,
        BuildOptions(dist_dir=tmp_path, source_date_epoch=1795910400),
    )
    assert again.sha256 == built_wheel.sha256
    assert again.path.read_bytes() == built_wheel.path.read_bytes()


@pytest.mark.slow
def test_members_the_build_writes_are_stored(built_wheel, touched):
    """The patched files and the rewritten .dist-info are stored: deflated, their bytes would
    be those of the zlib the building Python links, and differ by machine."""
    info = f"vllm-{built_wheel.version}.dist-info"
    rewritten = ("METADATA", "WHEEL", "RECORD", MANIFEST_NAME, f"sboms/{SBOM_NAME}")
    with zipfile.ZipFile(built_wheel.path) as zf:
        for name in sorted(touched) + [f"{info}/{leaf}" for leaf in rewritten]:
            member = zf.getinfo(name)
            assert member.compress_type == zipfile.ZIP_STORED, name
            assert raw(zf, member) == zf.read(member), name


#: In a child: its zlib, and the digest of what its deflate makes of a file.
_ZLIB_OF_CHILD = (
    "import hashlib, pathlib, sys, zlib\n"
    "c = zlib.compressobj(9, zlib.DEFLATED, -15)\n"
    "data = pathlib.Path(sys.argv[1]).read_bytes()\n"
    "print(zlib.ZLIB_RUNTIME_VERSION, hashlib.sha256(c.compress(data) + c.flush()).hexdigest())"
)


@pytest.mark.slow
def test_another_zlib_builds_the_same_wheel(tmp_path, patched_0201, other_libz):
    """The same build by the same interpreter linked to two zlibs whose deflate differs
    (this Python's, and zlib-ng's libz.so.1 put in front): the same bytes."""
    env = {**os.environ, "TOOLING_PROBE_PYTHON": "", "SOURCE_DATE_EPOCH": "1795910400"}
    front = os.pathsep.join(filter(None, [str(other_libz), os.environ.get("LD_LIBRARY_PATH")]))
    envs = {"linked": env, "other": {**env, "LD_LIBRARY_PATH": front}}
    zlib_of = {
        label: subprocess.run(
            [sys.executable, "-c", _ZLIB_OF_CHILD, __file__],
            env=child_env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        for label, child_env in envs.items()
    }
    # Two zlibs, and their deflate streams differ: a deflated member would differ too.
    assert zlib_of["linked"][0] != zlib_of["other"][0], zlib_of
    assert zlib_of["linked"][1] != zlib_of["other"][1], zlib_of
    built = {}
    for label, child_env in envs.items():
        out = build_without_probes(Path(patched_0201.work_dir), tmp_path / label, child_env)
        assert out["builder"]["zlib"] == zlib_of[label][0]
        built[label] = (out["filename"], out["sha256"])
    assert built["linked"] == built["other"]


@pytest.mark.slow
def test_a_build_without_probes_does_not_depend_on_the_trees_history(tmp_path, patched_0201):
    """The patched tree was probed when it was made: a --no-probes build on it records none
    of those verdicts, and writes the wheel a --no-probes build on a fresh tree writes."""
    assert all(o.probe_after for o in patched_0201.outcomes)
    env = {**os.environ, "TOOLING_PROBE_PYTHON": "", "SOURCE_DATE_EPOCH": "1795910400"}
    probed = build_without_probes(Path(patched_0201.work_dir), tmp_path / "probed", env)
    fresh = build_without_probes(tmp_path / "fresh-tree", tmp_path / "fresh", env)
    with zipfile.ZipFile(probed["wheel"]) as zf:
        info = f"vllm-{probed['version']}.dist-info"
        manifest = BuildManifest.from_json(json.loads(zf.read(f"{info}/{MANIFEST_NAME}")))
    assert {(p.probe_before, p.probe_after) for p in manifest.patches} == {(None, None)}
    assert probed["sha256"] == fresh["sha256"]


def build_without_probes(work_dir: Path, dist: Path, env: dict[str, str]) -> dict:
    """``tooling build --no-probes --json`` in a child; its JSON, the digest checked."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tooling",
            "--no-progress",
            "build",
            "--offline",
            "--no-probes",
            "--work-dir",
            str(work_dir),
            "--dist",
            str(dist),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=dist.parent,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    with open(out["wheel"], "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == out["sha256"]
    return out


@pytest.mark.slow
def test_skip_is_in_version_and_manifest(tmp_path, upstream_0201, series, cache):
    # Patch 5 is written on patch 2's lines, patch 22 on patch 5's, patches 32 and 40 on patch
    # 22's and patch 33 on patch 32's: leaving out patch 2 means leaving out all six. Patch 37
    # is the other that changes the DFlash model's file, which the build then leaves as it was.
    skip = [
        "context-kv-one-launch",
        "dflash-fp8-kv-cache",
        "dflash-step-graphs",
        "dflash-swa-config",
        "drafter-full-graphs",
        "gdn-spec-replay",
        "join-hold",
    ]
    partial = series.without(skip)
    upstream = touched_upstream(upstream_0201, series, tmp_path / "base")
    report = apply_series(upstream, partial, tmp_path / "w", apply_options(None, cache))
    result = build_precompiled(upstream, partial, report, BuildOptions(dist_dir=tmp_path))
    assert result.version == (
        f"0.20.1+dflash.{len(partial.patches)}.{partial.digest[:8]}"
        ".skip.contextkvonelaunch.dflashfp8kvcache.dflashstepgraphs.dflashswaconfig"
        ".drafterfullgraphs"
        ".gdnspecreplay.joinhold"
    )
    assert partial.digest != series.digest
    assert result.manifest.skipped == skip
    assert "vllm/model_executor/models/qwen3_dflash.py" not in {
        f.path for f in result.manifest.files
    }


def test_build_tag_mode(series):
    identity = plan_identity(OFFICIAL, series, build_tag="2")
    assert identity.filename == "vllm-0.20.1-2-cp38-abi3-manylinux_2_35_x86_64.whl"
    # The file name must stay PyPI-clean, but vLLM still reports the series label.
    assert runtime_version("0.20.1", series).startswith("0.20.1+dflash.")
    assert "Build: 2" in rewrite_wheel_file("Wheel-Version: 1.0\nTag: x\n", identity)
    with pytest.raises(BuildError, match="must be above the official build tag 1"):
        plan_identity(OFFICIAL, series, build_tag="1")
    with pytest.raises(BuildError, match="must start with a digit"):
        plan_identity(OFFICIAL, series, build_tag="dflash")


@pytest.mark.slow
def test_patch_touching_compiled_code_is_refused(tmp_path, upstream_0201, series, cache):
    kernel_file = "csrc/activation_kernels.cu"
    upstream = touched_upstream(upstream_0201, series, tmp_path / "base", (kernel_file,))
    report = apply_series(upstream, series, tmp_path / "w", apply_options(None, cache))
    repo = git.Repo(report.work_dir)
    kernel = Path(report.work_dir) / kernel_file
    kernel.write_text(kernel.read_text() + "// tuned\n")
    repo.git.commit(
        "-am",
        "kernel tweak\n\nPatch-File: 0004-kernel.patch\nPatch-Sha256: " + "0" * 64 + "\n",
        env=worktree.git_env(),
    )
    report = dataclasses.replace(report, head=repo.head.commit.hexsha)
    with pytest.raises(
        BuildError,
        match=r"patch 0004-kernel.patch touches compiled code "
        r"\(csrc/activation_kernels.cu\)",
    ):
        build_precompiled(upstream, series, report, BuildOptions(dist_dir=tmp_path / "d"))
    assert not (tmp_path / "d").exists()


@pytest.mark.slow
def test_source_that_differs_from_the_wheel_is_refused(tmp_path, upstream_0201, series, cache):
    upstream = touched_upstream(upstream_0201, series, tmp_path / "base")
    target = upstream.source_dir / "vllm" / "config" / "speculative.py"
    target.write_text(target.read_text() + "# a local change\n")
    report = apply_series(upstream, series, tmp_path / "w", apply_options(None, cache))
    with pytest.raises(BuildError, match="vllm/config/speculative.py: the official wheel's copy"):
        build_precompiled(upstream, series, report, BuildOptions(dist_dir=tmp_path / "d"))


@pytest.mark.slow
def test_corrupt_official_wheel_and_missing_wheel(tmp_path, upstream_0201, series, patched_0201):
    broken = tmp_path / OFFICIAL
    with open(upstream_0201.wheel, "rb") as src:
        broken.write_bytes(src.read(5_000_000))
    # A damaged official wheel is named for what it is: not the pinned file (and gone).
    with pytest.raises(IntegrityError, match="does not match the pinned .* moved aside to"):
        build_precompiled(
            dataclasses.replace(upstream_0201, wheel=broken),
            series,
            patched_0201,
            BuildOptions(dist_dir=tmp_path / "d"),
        )
    with pytest.raises(BuildError, match="has no pinned official wheel"):
        build_precompiled(
            dataclasses.replace(upstream_0201, wheel=None),
            series,
            patched_0201,
            BuildOptions(dist_dir=tmp_path / "d"),
        )
    assert not list((tmp_path / "d").glob("*.whl")) if (tmp_path / "d").exists() else True


@pytest.mark.slow
def test_unwritable_dist_is_a_build_error(tmp_path, upstream_0201, series, patched_0201):
    blocker = tmp_path / "dist"
    blocker.write_text("a file where the folder should be")
    with pytest.raises(BuildError, match="cannot write"):
        build_precompiled(upstream_0201, series, patched_0201, BuildOptions(dist_dir=blocker))


@pytest.mark.slow
def test_full_disk_leaves_nothing_behind(tmp_path, patched_0201, upstream_0201):
    """A write that fails half-way (file size limit standing in for a full disk)."""
    dist = tmp_path / "dist"
    dist.mkdir()

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (50_000_000, 50_000_000))

    env = {**os.environ, "TOOLING_PROBE_PYTHON": ""}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tooling",
            "--no-progress",
            "build",
            "--no-probes",
            "--work-dir",
            patched_0201.work_dir,
            "--dist",
            str(dist),
        ],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == BuildError.exit_code, proc.stderr
    assert "cannot write" in proc.stderr and "File too large" in proc.stderr
    assert list(dist.iterdir()) == []
