"""The release pipeline: workflow validity, make-only jobs, Makefile targets, release notes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from tooling.building.manifest import MANIFEST_NAME
from tooling.cli import main
from tooling.errors import ArchiveError, ReleaseError
from tooling.patching.status import BaseStatus
from tooling.paths import REPO_DIR
from tooling.release.release import (
    read_wheel_manifest,
    release_notes,
    upstream_since,
    write_release,
)

from .helpers import plain_manifest

WORKFLOWS = sorted((REPO_DIR / ".github" / "workflows").glob("*.yml"))
#: Jobs that only decide whether another job runs, and say why when it does not.
GATES = {"gpu-runner"}


def test_workflows_pass_the_github_actions_schema():
    assert WORKFLOWS
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "check-jsonschema"),
            "--builtin-schema",
            "vendor.github-workflows",
            *map(str, WORKFLOWS),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_workflow_is_caught(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "on: push\njobs:\n  x:\n    runs-on: ubuntu-24.04\n    steps:\n"
        "      - run: make test\n        shell: 42\n        uses: also/this@v1\n"
    )
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "check-jsonschema"),
            "--builtin-schema",
            "vendor.github-workflows",
            str(broken),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0


def test_jobs_call_make_targets_only():
    makefile = (REPO_DIR / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z-]+):", makefile, re.M))
    for workflow in WORKFLOWS:
        jobs = yaml.safe_load(workflow.read_text())["jobs"]
        assert {"lint", "test", "wheel", "canary", "smoke", "publish"} <= set(jobs)
        for name, job in jobs.items():
            if name in GATES:
                continue
            for step in job["steps"]:
                if "run" in step:
                    match = re.fullmatch(r"make ([a-z-]+)", step["run"].strip())
                    assert match, f"{name}: `{step['run']}` is not a make target"
                    assert match.group(1) in targets


def test_no_workflow_github_reads_is_a_link():
    """GitHub Actions does not follow a linked workflows folder or a linked workflow file."""
    folder = REPO_DIR / ".github" / "workflows"
    assert not (REPO_DIR / ".github").is_symlink() and not folder.is_symlink()
    assert folder.is_dir() and WORKFLOWS
    for workflow in folder.iterdir():
        assert not workflow.is_symlink() and workflow.is_file(), workflow


def test_every_job_states_its_own_least_permissions():
    for workflow in WORKFLOWS:
        data = yaml.safe_load(workflow.read_text())
        assert data["permissions"] == {}, "the default for every job: nothing"
        for name, job in data["jobs"].items():
            granted = job.get("permissions")
            assert granted is not None, f"{name}: no permissions of its own"
            writes = {k for k, v in granted.items() if v == "write"}
            assert writes <= ({"contents"} if name == "publish" else set()), name


def test_every_make_target_has_help():
    help_text = subprocess.run(
        ["make", "-s", "help"], cwd=REPO_DIR, capture_output=True, text=True, check=True
    ).stdout
    for target in ("wheel", "test", "lint", "verify", "smoke", "status", "release", "clean"):
        assert re.search(rf"^  {target}\s+\S", help_text, re.M), target


def small_built_wheel(dist: Path, payload: bytes) -> Path:
    """A wheel as the build names and stamps it (its manifest inside), ``payload`` stored."""
    manifest = plain_manifest("0.20.1+dflash.6.0")
    wheel = dist / "vllm-0.20.1+dflash.6.0-cp38-abi3-manylinux_2_35_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("vllm/blob.bin", payload)
        zf.writestr(f"vllm-0.20.1+dflash.6.0.dist-info/{MANIFEST_NAME}", manifest.to_bytes())
        zf.writestr(
            "vllm-0.20.1+dflash.6.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nTag: cp38-abi3-manylinux_2_35_x86_64\n",
        )
    return wheel


def test_release_refuses_a_wheel_with_one_flipped_byte_and_writes_nothing(tmp_path):
    """verify --wheel and bundle refuse such a wheel (a member fails its CRC-32); release
    wrote checksums and notes for it."""
    payload = bytes(range(256)) * 64
    good = tmp_path / "good"
    good.mkdir()
    small_built_wheel(good, payload)
    result = CliRunner().invoke(main, ["release", "--dist", str(good)])
    assert result.exit_code == 0, result.output
    bad = tmp_path / "bad"
    bad.mkdir()
    wheel = small_built_wheel(bad, payload)
    data = bytearray(wheel.read_bytes())
    data[data.find(payload) + len(payload) // 2] ^= 0x01
    wheel.write_bytes(data)
    result = CliRunner().invoke(main, ["release", "--dist", str(bad)])
    assert result.exit_code == ArchiveError.exit_code, result.output
    assert result.stderr == (
        f"error: {wheel}: member vllm/blob.bin is corrupt (Bad CRC-32 for file 'vllm/blob.bin')\n"
    )
    assert list(bad.iterdir()) == [wheel]


def status_json(*reports) -> dict:
    return {"bases": [BaseStatus(r.base, r).to_json() for r in reports]}


def test_upstream_since_is_the_lowest_release_by_version_order():
    """0.10.0 sorts after 0.9.1 (not as text), and a post-release after its release."""

    def entry(base: str, status: str) -> dict:
        return {"base": base, "report": {"outcomes": [{"patch_id": "p", "status": status}]}}

    status = {
        "bases": [
            entry("0.10.0", "superseded"),
            entry("0.9.1.post1", "already-applied"),
            entry("0.9.1", "superseded"),
            entry("0.9.0", "applied"),
            {"base": "0.8.0", "report": None, "error": "could not fetch"},
        ]
    }
    assert upstream_since(status, "p") == "0.9.1"
    assert upstream_since(status, "other") is None


@pytest.mark.slow
def test_release_notes_from_the_real_build(built_wheel, series, patched_0201, patched_0220):
    status = status_json(patched_0201, patched_0220)
    assert upstream_since(status, "dflash-layer-id-offset") == "0.22.0"
    assert upstream_since(status, "eagle-cache-drop") is None
    manifest = read_wheel_manifest(built_wheel.path)
    notes = release_notes(series, manifest, built_wheel.filename, built_wheel.sha256, status)
    assert notes.startswith(f"# vLLM {built_wheel.version}\n")
    assert built_wheel.sha256 in notes
    assert f"- `vllm.__version__`: `{built_wheel.version}`" in notes
    carried = notes.split("## Patches carried")[1].split("##")[0]
    for patch in series.patches:
        assert patch.title in carried
    assert "Upstream from 0.22.0: drop when upgrading." in carried
    row = "| 0.22.0 | superseded | conflict | applied | applied | superseded | applied |"
    assert row in notes
    assert "## Dropped: already upstream in this base\n\n- none" in notes


@pytest.mark.slow
def test_write_release_checksums(tmp_path, built_wheel, series, patched_0201):
    dist = tmp_path / "dist"
    dist.mkdir()
    wheel = dist / built_wheel.filename
    wheel.symlink_to(built_wheel.path)
    files = write_release(dist, wheel, series, status_json(patched_0201))
    sums = dict(reversed(line.split("  ")) for line in files.checksums.read_text().splitlines())
    assert set(sums) == {
        built_wheel.filename,
        f"{built_wheel.filename}.manifest.json",
        "RELEASE_NOTES.md",
    }
    assert sums[built_wheel.filename] == built_wheel.sha256
    subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=dist, check=True)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_make_smoke_says_it_needs_a_gpu():
    result = subprocess.run(["make", "-s", "smoke"], cwd=REPO_DIR, capture_output=True, text=True)
    assert result.returncode != 0
    assert "needs an NVIDIA GPU" in result.stderr


def test_every_action_is_pinned_to_a_full_commit():
    """A tag can be moved to other code; a commit cannot (zizmor's unpinned-uses)."""
    uses = [
        step["uses"]
        for workflow in WORKFLOWS
        for job in yaml.safe_load(workflow.read_text())["jobs"].values()
        for step in job.get("steps", [])
        if "uses" in step
    ]
    assert uses
    for use in uses:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", use), use


def test_zizmor_finds_nothing_from_low_severity_up_offline():
    zizmor = Path(sys.executable).parent / "zizmor"
    result = subprocess.run(
        [str(zizmor), "--offline", "--min-severity", "low", *map(str, WORKFLOWS)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"bases": [', "cannot read the status matrix (not JSON: "),
        ('{"ok": true}', "not the output of `tooling patch status --json`"),
        ('{"bases": [{"base": "0.22.0", "report": {}}]}', "not the output of"),
        ('{"probed": false, "bases": []}', "made with --no-probes"),
    ],
)
def test_release_names_a_status_json_it_cannot_use_and_writes_nothing(tmp_path, text, why):
    dist = tmp_path / "dist"
    dist.mkdir()
    wheel = small_built_wheel(dist, b"x")
    status = tmp_path / "status.json"
    status.write_text(text)
    result = CliRunner().invoke(
        main, ["release", "--dist", str(dist), "--status-json", str(status)]
    )
    assert result.exit_code == ReleaseError.exit_code, result.output
    assert result.stderr.startswith(f"error: {status}: {why}"), result.stderr
    assert result.stderr.count("\n") == 1
    assert list(dist.iterdir()) == [wheel]
