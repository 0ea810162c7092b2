"""The CLI's promises under concurrency and damage, with real processes: runs at once, a
person's work in the work tree, a full disk and bad or read-only cache entries must never
cost anyone their tree, their work or a good cached file."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tooling.paths import REPO_DIR

from .helpers import git, wait_until
from .reliability_helpers import CACHE, finish, needs_artifacts, tooling

SDIST = "vllm-0.20.1.tar.gz"
WHEEL = "vllm-0.20.1-1-cp38-abi3-manylinux_2_35_x86_64.whl"


def fresh_cache(tmp_path: Path, *files: str) -> Path:
    """A cache of its own holding only links to the real pinned artifacts."""
    cache = tmp_path / "cache"
    (cache / "pypi").mkdir(parents=True)
    for name in files:
        (cache / "pypi" / name).symlink_to(CACHE / "pypi" / name)
    return cache


@pytest.mark.slow
@needs_artifacts
def test_two_builds_at_once_share_the_work_tree_safely(tmp_path, probe_python):
    """B starts while A waits for its base probes; neither may patch the other's tree."""
    env = {"TOOLING_PROBE_PYTHON": str(probe_python)}
    a = tooling("build", "--json", "--dist", "dist-a", cwd=tmp_path, env=env)
    work = tmp_path / "build" / "work" / "vllm-0.20.1"
    # A has created its tree and is waiting for the base probes: the moment B used to replace it.
    wait_until(lambda: (work / ".git" / "refs" / "tags" / "baseline").exists(), "A's tree", alive=a)
    b = tooling("build", "--json", "--dist", "dist-b", cwd=tmp_path, env=env)
    (code_a, out_a, err_a), (code_b, out_b, err_b) = finish(a), finish(b)
    assert (code_a, code_b) == (0, 0), (err_a, err_b)
    for out in (out_a, out_b):
        statuses = {p["id"]: p["status"] for p in json.loads(out)["patches"]}
        assert set(statuses.values()) == {"applied"}, statuses
    assert json.loads(out_a)["sha256"] == json.loads(out_b)["sha256"]
    # One baseline and one commit per patch: nobody's commits landed in another tree.
    patches = json.loads(out_a)["patches"]
    assert len(git(work, "rev-list", "baseline..HEAD").split()) == len(patches)
    saved = json.loads((work / ".git" / "dflash-series.json").read_text())
    assert {o["status"] for o in saved["outcomes"]} == {"applied"}
    assert sorted(p.name for p in work.parent.iterdir()) == ["vllm-0.20.1", "vllm-0.20.1.logs"]


@pytest.mark.slow
@needs_artifacts
def test_two_trees_from_one_fresh_cache_do_not_break_each_other(tmp_path):
    """Both unpack the sdist into the same cache; neither may delete it under the other."""
    cache = fresh_cache(tmp_path, SDIST)
    env = {"VLLM_DFLASH_CACHE": str(cache), "TOOLING_PROBE_PYTHON": ""}
    a = tooling("patch", "--offline", "--json", "--work-dir", "wa", cwd=tmp_path, env=env)
    # B starts unpacking just after A: A then copies the tree while B finishes its own copy.
    wait_until(lambda: any((cache / "sources").glob(".sdist-*")), "A unpacking", alive=a)
    b = tooling("patch", "--offline", "--json", "--work-dir", "wb", cwd=tmp_path, env=env)
    results = [finish(a), finish(b)]
    for code, out, err in results:
        assert code == 0, err
        assert {o["status"] for o in json.loads(out)["outcomes"]} == {"applied"}
    sources = [p for p in (cache / "sources").iterdir() if not p.name.startswith(".")]
    assert len(sources) == 1
    assert not [p for p in (cache / "sources").iterdir() if p.name.endswith(".part")]


def patch_w(folder: Path) -> tuple[int, str, str]:
    """``tooling patch`` of the work tree ``w`` in ``folder`` (no probes)."""
    env = {"TOOLING_PROBE_PYTHON": "", "VLLM_DFLASH_CACHE": str(CACHE)}
    return finish(tooling("patch", "--offline", "--json", "--work-dir", "w", cwd=folder, env=env))


@pytest.mark.slow
@needs_artifacts
def test_a_persons_commits_in_the_work_tree_are_moved_aside_not_destroyed(tmp_path):
    code, out, err = patch_w(tmp_path)
    assert code == 0, err
    # A tree holding only our commits is simply made again.
    code, out, err = patch_w(tmp_path)
    assert code == 0, err
    assert json.loads(out)["saved_work"] is None
    # Nothing beside the tree: no saved copy (and no probe logs: no probe interpreter here).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]
    work = tmp_path / "w"
    (work / "vllm" / "NOTES.txt").write_text("a new patch in the making\n")
    git(work, "add", "vllm/NOTES.txt")
    person = ["-c", "user.name=A Person", "-c", "user.email=person@example.com"]
    git(work, *person, "commit", "-q", "-m", "my new patch")
    mine = git(work, "rev-parse", "HEAD")
    code, out, err = patch_w(tmp_path)
    assert code == 0, err
    saved = Path(json.loads(out)["saved_work"])
    assert saved.parent == tmp_path and saved.name.startswith("w.saved-")
    assert git(saved, "rev-parse", "HEAD") == mine
    assert str(saved) in err
    assert mine not in git(work, "rev-list", "HEAD")


@pytest.mark.slow
@needs_artifacts
def test_files_vllms_gitignore_hides_in_the_work_tree_are_moved_aside_not_destroyed(tmp_path):
    code, out, err = patch_w(tmp_path)
    assert code == 0, err
    work = tmp_path / "w"
    (work / "bench.log").write_text("tokens/s 612\n")
    (work / ".venv" / "bin").mkdir(parents=True)
    (work / ".venv" / "bin" / "python").write_text("")
    (work / "build").mkdir()
    (work / "build" / "x").write_text("")
    assert git(work, "status", "--porcelain") == ""  # all three hidden from a plain status
    code, out, err = patch_w(tmp_path)
    assert code == 0, err
    saved = Path(json.loads(out)["saved_work"])
    assert str(saved) in err
    assert (saved / "bench.log").read_text() == "tokens/s 612\n"
    assert (saved / ".venv" / "bin" / "python").is_file() and (saved / "build" / "x").is_file()


@pytest.mark.slow
@needs_artifacts
def test_a_full_disk_while_the_work_tree_is_made_is_one_line_and_leaves_nothing(
    tmp_path, probe_python
):
    """The file size limit stands in for a full disk: the kernel's EFBIG where Python
    writes, SIGXFSZ where git does (the tree is a clone of the source's baseline)."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {
        **os.environ,
        "TOOLING_PROBE_PYTHON": str(probe_python),
        "VLLM_DFLASH_CACHE": str(CACHE),
        "TMPDIR": str(scratch),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tooling", "patch", "--offline", "--work-dir", "w"],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 13, proc.stderr
    assert proc.stderr.startswith(f"error: cannot create the work tree {tmp_path / 'w'}: ")
    full = ("File too large", "killed by SIGXFSZ (File size limit exceeded)")
    assert any(f in proc.stderr for f in full) and proc.stderr.count("\n") == 1, proc.stderr
    # Only the probe log stays; the base probes were stopped and their temp folder removed.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp", "w.logs"]
    assert list(scratch.iterdir()) == []


@pytest.mark.slow
@needs_artifacts
def test_a_truncated_cached_wheel_is_named_when_it_is_removed(tmp_path, catalog):
    cache = fresh_cache(tmp_path, SDIST)
    # The unpacked source as well: unpacking it again is not what this test is about.
    name = f"sdist-{catalog.get('0.20.1').sdist.sha256[:16]}"
    (cache / "sources").mkdir()
    (cache / "sources" / name).symlink_to(CACHE / "sources" / name)
    with open(CACHE / "pypi" / WHEEL, "rb") as f:
        (cache / "pypi" / WHEEL).write_bytes(f.read(1_000_000))
    env = {"TOOLING_PROBE_PYTHON": "", "VLLM_DFLASH_CACHE": str(cache)}
    args = ("build", "--offline", "--no-probes", "--work-dir", "w", "--dist", "dist")
    code, _, err = finish(tooling(*args, cwd=tmp_path, env=env))
    assert code == 6, err
    assert err.startswith(f"error: {WHEEL}: sha256 ") and "moved aside to" in err, err
    assert not (cache / "pypi" / WHEEL).exists()
    # Its size gave it away before any work: no work tree was made for it.
    assert not (tmp_path / "w").exists()
    assert not list(tmp_path.glob("dist/*"))


@pytest.mark.slow
@needs_artifacts
def test_a_wrong_pin_moves_the_right_cached_wheel_aside_and_says_where(tmp_path, catalog):
    """One hex digit off in bases.toml's wheel pin: the build stops (6), and the real official
    wheel is out of the cache's way, whole, never deleted."""
    cache = fresh_cache(tmp_path, SDIST, WHEEL)
    name = f"sdist-{catalog.get('0.20.1').sdist.sha256[:16]}"
    (cache / "sources").mkdir()
    (cache / "sources" / name).symlink_to(CACHE / "sources" / name)
    patches = shutil.copytree(REPO_DIR / "patches", tmp_path / "patches")
    pinned = catalog.get("0.20.1").wheel.sha256
    wrong = ("0" if pinned[0] != "0" else "1") + pinned[1:]
    bases = patches / "bases.toml"
    bases.write_text(bases.read_text().replace(pinned, wrong))
    env = {"TOOLING_PROBE_PYTHON": "", "VLLM_DFLASH_CACHE": str(cache)}
    args = ("--patches-dir", str(patches), "build", "--offline", "--no-probes", "--work-dir", "w")
    code, _, err = finish(tooling(*args, "--dist", "dist", cwd=tmp_path, env=env))
    aside = cache / "pypi" / "rejected" / f"{WHEEL}.sha256-{pinned[:16]}"
    assert code == 6, err
    assert err == (
        f"error: {WHEEL}: sha256 {pinned} does not match the pinned {wrong}; "
        f"the file was moved aside to {aside} (check the pin in bases.toml)\n"
    )
    assert not (cache / "pypi" / WHEEL).exists()
    assert aside.resolve() == (CACHE / "pypi" / WHEEL).resolve()  # the link, the wheel untouched
    assert not list(tmp_path.glob("dist/*"))


@pytest.fixture
def immutable(tmp_path):
    """Folders even root cannot write into (chattr +i), made writable again afterwards."""
    made: list[Path] = []

    def make(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(["chattr", "+i", str(folder)], check=True)
        made.append(folder)
        return folder

    yield make
    for folder in made:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.mark.slow
@needs_artifacts
def test_a_read_only_cache_is_used_when_it_holds_the_entry_and_named_when_not(
    tmp_path, catalog, immutable
):
    name = f"sdist-{catalog.get('0.20.1').sdist.sha256[:16]}"
    full = fresh_cache(tmp_path / "full", SDIST)
    (full / "sources").mkdir()
    (full / "sources" / name).symlink_to(CACHE / "sources" / name)
    immutable(full / "sources")
    args = ("fetch", "--offline", "--no-wheel")
    code, _, err = finish(tooling(*args, cwd=tmp_path, env={"VLLM_DFLASH_CACHE": str(full)}))
    assert code == 0, err
    empty = fresh_cache(tmp_path / "empty", SDIST)
    immutable(empty / "sources")
    code, _, err = finish(tooling(*args, cwd=tmp_path, env={"VLLM_DFLASH_CACHE": str(empty)}))
    assert code == 20 and err.startswith(f"error: cannot write to {empty / 'sources'}: "), err
    assert err.count("\n") == 1
