"""The CLI's promises under faults, with real processes: concurrent runs, a person's work
in the work tree, refs that do not match their base, signals, one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tooling.paths import REPO_DIR, default_cache_dir

from .helpers import git, wait_until

#: The session's cache (conftest points $VLLM_DFLASH_CACHE at it before tests are collected).
CACHE = default_cache_dir(os.environ)
SDIST = "vllm-0.20.1.tar.gz"
WHEEL = "vllm-0.20.1-1-cp38-abi3-manylinux_2_35_x86_64.whl"
EPOCH = "1795910400"
#: Tests that run on the real pinned 0.20.1 artifacts (fetched and linked into CACHE by
#: the fixture; ``make check`` skips them).
needs_artifacts = pytest.mark.usefixtures("upstream_0201")


def tooling(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A real `tooling` process (as `python -m tooling`), stdout and stderr captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "tooling", "--no-progress", *args],
        cwd=cwd,
        env={**os.environ, "SOURCE_DATE_EPOCH": EPOCH, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_at_a_terminal,
    )


def as_at_a_terminal() -> None:
    """Ctrl-C reaches the child as it would at a terminal, even when these tests run in the
    background, whose shell starts them with SIGINT ignored (and an interpreter started so
    rightly leaves it ignored, as nohup means)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


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


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, upstream_0201) -> tuple[Path, dict[str, str], Path]:
    """A folder whose work tree `w` is patched (no probes), and the env that built it
    (``upstream_0201``: the pinned artifacts it builds from are in CACHE).

    The environment configures a probe interpreter that only leaves a mark, so
    the build shows whether --no-probes started it.
    """
    root = tmp_path_factory.mktemp("prepared")
    marker = root / "probe-started"
    probe = root / "probe-python"
    probe.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    probe.chmod(0o755)
    env = {"TOOLING_PROBE_PYTHON": str(probe), "VLLM_DFLASH_CACHE": str(CACHE)}
    build = tooling(
        "build", "--offline", "--no-probes", "--json", "--work-dir", "w", cwd=root, env=env
    )
    code, out, err = finish(build)
    assert code == 0, err
    (root / "first-build.json").write_text(out)
    return root, env, marker


@pytest.mark.slow
def test_no_probes_runs_no_probe_interpreter_even_when_one_is_configured(prepared):
    root, _, marker = prepared
    assert not marker.exists()
    out = json.loads((root / "first-build.json").read_text())
    assert {p["probe"] for p in out["patches"]} == {None}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)]
)
@needs_artifacts
def test_a_signal_during_the_build_leaves_no_part_file(prepared, signum, code):
    """CI cancel, a closed terminal, Ctrl-C: the half-written wheel goes, the exit says why."""
    root, env, _ = prepared
    dist = root / f"dist-{signum}"
    build = tooling(
        "build",
        "--offline",
        "--no-probes",
        "--work-dir",
        "w",
        "--dist",
        dist.name,
        cwd=root,
        env=env,
    )
    wait_until(lambda: any(dist.glob(".*.part")), "the wheel being written", alive=build)
    build.send_signal(signum)
    got, _, err = finish(build)
    assert got == code, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert list(dist.iterdir()) == []


BOOM = """
import sys, time
from tooling.cli import main

@main.command("boom")
def boom():
    raise RuntimeError("kaboom")

@main.command("nap")
def nap():
    print("napping", flush=True)
    time.sleep(60)

main()
"""


def cli_with_extra_commands(*args: str) -> subprocess.Popen:
    """The real CLI group with two commands of this test: one that fails, one that waits."""
    return subprocess.Popen(
        [sys.executable, "-c", BOOM, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_at_a_terminal,
    )


def test_an_unexpected_error_is_one_line_and_exit_1_with_the_traceback_under_debug():
    code, _, err = finish(cli_with_extra_commands("boom"))
    assert (code, err) == (
        1,
        "error: unexpected RuntimeError: kaboom (rerun with --debug for the traceback)\n",
    )
    code, _, err = finish(cli_with_extra_commands("--debug", "boom"))
    assert code == 1
    assert "Traceback" in err and err.rstrip().endswith("RuntimeError: kaboom")


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)]
)
def test_signals_exit_128_plus_their_number(signum, code):
    proc = cli_with_extra_commands("nap")
    assert proc.stdout.readline() == "napping\n"
    proc.send_signal(signum)
    got, _, err = finish(proc)
    assert got == code
    assert err == f"error: interrupted ({signal.Signals(signum).name})\n"


#: Atomic writes interrupted at every instant: a one-shot timer whose handler raises, as the
#: CLI's does for SIGTERM and SIGHUP, set from 1 to 600 microseconds ahead of each write
#: (every hundredth write is left alone, so some finish on any machine).
RACE = """
import signal, sys
from pathlib import Path
from tooling.fsutil import atomic_output, staging_dir

class Tick(BaseException):
    pass

def tick(signum, frame):
    raise Tick()

folder, which, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
signal.signal(signal.SIGALRM, tick)
interrupted = done = 0
for i in range(n):
    try:
        if i % 100 != 99:
            signal.setitimer(signal.ITIMER_REAL, 1e-6 * (1 + i % 600))
        try:
            if which == "file":
                with atomic_output(folder / "out.bin", durable=False) as f:
                    f.write(b"x")
            else:
                with staging_dir(folder / f"tree-{i}") as tmp:
                    (tmp / "a").write_bytes(b"x")
            done += 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except Tick:
        interrupted += 1
signal.signal(signal.SIGALRM, signal.SIG_IGN)
print(interrupted, done)
"""


@pytest.mark.parametrize("which", ["file", "dir"])
def test_a_signal_at_any_instant_of_an_atomic_write_leaves_no_part(tmp_path, which):
    """The temp sibling is named before it is made and made inside the block that removes
    it: a signal raised the moment it exists still removes it (the build's wheel was left as
    ``.part`` by a SIGHUP that came between the two)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_DIR)}
    done = subprocess.run(
        [sys.executable, "-c", RACE, str(tmp_path), which, "2000"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    interrupted, finished = map(int, done.stdout.split())
    assert interrupted > 0 and finished >= 20
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


@pytest.mark.slow
@needs_artifacts
@pytest.mark.parametrize("kind", ["missing", "not-python"])
def test_a_probe_interpreter_that_cannot_start_is_a_probe_error(tmp_path, kind):
    python = tmp_path / "bin" / "python"
    if kind == "not-python":
        python.parent.mkdir()
        python.write_text("#!/bin/sh\nexit 1\n")
        python.chmod(0o755)
    env = {"TOOLING_PROBE_PYTHON": str(python), "VLLM_DFLASH_CACHE": str(CACHE)}
    code, _, err = finish(tooling("patch", "--offline", "--work-dir", "w", cwd=tmp_path, env=env))
    assert code == 12, err
    assert err.startswith(f"error: probe interpreter {python}") and err.count("\n") == 1, err
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
@needs_artifacts
def test_a_dist_that_is_a_file_is_refused_before_any_work(tmp_path):
    (tmp_path / "dist").write_text("not a folder")
    env = {"TOOLING_PROBE_PYTHON": "", "VLLM_DFLASH_CACHE": str(CACHE)}
    args = ("build", "--offline", "--no-probes", "--work-dir", "w", "--dist", "dist")
    code, _, err = finish(tooling(*args, cwd=tmp_path, env=env))
    assert (code, err) == (13, f"error: --dist {tmp_path / 'dist'} is a file, not a folder\n")
    assert not (tmp_path / "w").exists()


def test_verify_with_an_interpreter_that_is_not_python_is_one_line(tmp_path):
    code, _, err = finish(tooling("verify", "--python", "/bin/true", cwd=tmp_path))
    assert (code, err) == (
        16,
        "error: /bin/true is not a Python interpreter: it printed no answer\n",
    )


def test_pip_refusing_a_wheel_shows_pips_error_line(tmp_path):
    from tooling.verifying.install import pip_install

    bad = tmp_path / "vllm-0.20.1-cp38-abi3-manylinux_2_35_x86_64.whl"
    bad.write_bytes(b"not a zip archive")
    failure = pip_install(bad, target=tmp_path / "site")
    assert failure is not None and failure.startswith("ERROR:"), failure


@pytest.mark.slow
@pytest.mark.parametrize(
    ("epoch", "message"),
    [
        ("yesterday", "is not a whole number of seconds"),
        ("4354819200", "is past 2107, the last year a zip can hold"),
    ],
)
@needs_artifacts
def test_a_bad_source_date_epoch_is_one_line(prepared, epoch, message):
    root, env, _ = prepared
    args = ("build", "--offline", "--no-probes", "--work-dir", "w", "--dist", "dist-epoch")
    code, _, err = finish(tooling(*args, cwd=root, env={**env, "SOURCE_DATE_EPOCH": epoch}))
    assert code == 13 and err == f"error: SOURCE_DATE_EPOCH {epoch!r} {message}\n", err


@pytest.mark.slow
def test_release_refuses_a_foreign_wheel_and_a_wheel_outside_dist_before_writing(
    prepared, tmp_path
):
    root, env, _ = prepared
    foreign = tmp_path / "d" / "vllm-0.20.1-1-cp38-abi3-manylinux_2_35_x86_64.whl"
    foreign.parent.mkdir()
    with zipfile.ZipFile(foreign, "w") as zf:
        zf.writestr("vllm-0.20.1.dist-info/METADATA", "Name: vllm\nVersion: 0.20.1\n")
    code, _, err = finish(tooling("release", "--dist", "d", cwd=tmp_path, env=env))
    assert code == 13 and err.startswith(f"error: {foreign.name} has no dflash_build.json"), err
    assert [p.name for p in foreign.parent.iterdir()] == [foreign.name]
    ours = next((root / "dist").glob("vllm-*.whl"))
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = finish(tooling("release", "--wheel", str(ours), "--dist", "empty", cwd=tmp_path))
    assert code == 13 and err.startswith(f"error: {ours} is not inside --dist"), err
    assert list(empty.iterdir()) == []


def test_patch_status_json_with_a_broken_series_is_json(tmp_path):
    patches = tmp_path / "patches"
    shutil.copytree(REPO_DIR / "patches", patches)
    (patches / "series.toml").write_text("[[patch]\nbroken")
    args = ("--patches-dir", str(patches), "patch", "status", "--json")
    code, out, err = finish(tooling(*args, cwd=tmp_path))
    assert code == 10 and err.count("\n") == 1, err
    assert json.loads(out)["exit_code"] == 10


@pytest.mark.slow
@needs_artifacts
def test_without_git_on_path_commands_that_need_none_work(tmp_path):
    path = {"PATH": str(Path(sys.executable).parent)}
    code, out, err = finish(tooling("verify", "--help", cwd=tmp_path, env=path))
    assert code == 0 and "Usage:" in out, err
    env = {**path, "TOOLING_PROBE_PYTHON": "", "VLLM_DFLASH_CACHE": str(CACHE)}
    code, _, err = finish(tooling("patch", "--offline", "--work-dir", "w", cwd=tmp_path, env=env))
    assert (code, err) == (
        18,
        "error: git is not installed (not found on PATH); the work tree needs it\n",
    )


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


def test_verify_of_a_dist_info_without_metadata_is_one_line(tmp_path):
    site = tmp_path / "site"
    (site / "vllm-0.20.1.dist-info").mkdir(parents=True)
    (site / "vllm-0.20.1.dist-info" / "RECORD").write_text("")
    code, _, err = finish(tooling("verify", "--site-packages", str(site), cwd=tmp_path))
    dist_info = site / "vllm-0.20.1.dist-info"
    assert (code, err) == (
        16,
        f"error: {dist_info} has no METADATA: not an installed distribution\n",
    )


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


def test_smoke_trained_names_what_the_recipe_lacks(tmp_path):
    # This interpreter has no torch, so the recipe (a child of it) refuses to train and
    # says why through its outcome: the same error, and exit code, here.
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is importable here: the recipe would train")
    code, out, err = finish(
        tooling("smoke", "--trained", "--workdir", str(tmp_path / "w"), cwd=tmp_path)
    )
    assert code == 18 and out == ""
    assert err.startswith("error: missing Python packages: torch, ") and err.count("\n") == 1
