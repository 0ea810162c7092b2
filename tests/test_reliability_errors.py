"""The CLI's promises when a run is stopped or its input is wrong, with real processes: a
signal or a bad interpreter, flag, file or environment ends in one line and its exit code,
and leaves no half-written file behind."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tooling.paths import REPO_DIR

from .helpers import wait_until
from .reliability_helpers import CACHE, as_at_a_terminal, finish, needs_artifacts, tooling


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
