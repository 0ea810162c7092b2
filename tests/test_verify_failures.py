"""verify when its helpers fail: one line and its exit code, and no probe left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tooling.errors import (
    EnvironmentProblem,
    ProbeError,
    VerifyIntegrityError,
    VllmNotFoundError,
)
from tooling.probing import UNKNOWN, ProbeTarget, start_probes
from tooling.verifying.verify import (
    InstalledDist,
    install_into_fresh_env,
    locate_with_python,
    read_record,
    verify,
)

from .helpers import wait_until


def _failing_python(tmp_path: Path) -> Path:
    """An interpreter that starts and fails the way a broken probe env does."""
    python = tmp_path / "broken-python"
    python.write_text("#!/bin/sh\necho 'Fatal Python error: init_fs_encoding' >&2\nexit 3\n")
    python.chmod(0o755)
    return python


def test_a_failing_probe_interpreter_is_one_line(tmp_path):
    broken = _failing_python(tmp_path)
    with pytest.raises(ProbeError) as e:
        install_into_fresh_env(tmp_path / "x.whl", broken, tmp_path / "venv")
    assert str(e.value) == (
        f"cannot ask the probe interpreter {broken} for its site-packages: "
        "exit status 3: Fatal Python error: init_fs_encoding"
    )


def test_a_missing_probe_interpreter_is_one_line(tmp_path):
    missing = tmp_path / "nope" / "python"
    with pytest.raises(ProbeError) as e:
        install_into_fresh_env(tmp_path / "x.whl", missing, tmp_path / "venv")
    assert str(e.value) == (
        f"cannot ask the probe interpreter {missing} for its site-packages: "
        "No such file or directory"
    )


def test_a_venv_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    dest = tmp_path / "file" / "venv"
    with pytest.raises(EnvironmentProblem) as e:
        install_into_fresh_env(tmp_path / "x.whl", Path(sys.executable), dest)
    assert str(e.value).startswith(f"cannot create a virtualenv at {dest}: ")
    assert "\n" not in str(e.value)


def test_pip_failing_on_the_wheel_is_one_line(tmp_path):
    wheel = tmp_path / "vllm-0.20.1-py3-none-any.whl"
    wheel.write_bytes(b"not a zip")
    with pytest.raises(VllmNotFoundError) as e:
        install_into_fresh_env(wheel, Path(sys.executable), tmp_path / "venv")
    assert str(e.value).startswith(f"pip could not install {wheel.name}: ")
    assert "\n" not in str(e.value)


@pytest.fixture
def slow_probe(tmp_path, monkeypatch) -> Iterator[tuple[ProbeTarget, str, Path]]:
    """A probe interpreter that hangs (as one stuck importing vLLM does).

    Its processes are found by a marker in their environment, which they
    carry from the moment they are started.
    """
    python = tmp_path / "slow-python"
    python.write_text("#!/bin/sh\nexec sleep 300\n")
    python.chmod(0o755)
    marker = f"SLOW_PROBE_MARKER={tmp_path}"
    monkeypatch.setenv("SLOW_PROBE_MARKER", str(tmp_path))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    yield ProbeTarget(python=python), marker, scratch
    for pid in _running(marker):  # what a failing test left behind
        os.kill(pid, signal.SIGKILL)


def _running(marker: str) -> list[int]:
    """Live (not zombie) processes whose environment holds ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if marker.encode() in environ:
            found.append(int(proc.name))
    return found


def test_a_failed_verify_leaves_no_probe_running(tmp_path, slow_probe):
    """RECORD is missing: verify fails after the probes started, and stops them."""
    target, marker, scratch = slow_probe
    site = tmp_path / "site"
    (site / "vllm-0.20.1.dist-info").mkdir(parents=True)  # no RECORD in it
    dist = InstalledDist("0.20.1", site, "vllm-0.20.1.dist-info")
    with pytest.raises(VerifyIntegrityError, match="RECORD is missing"):
        verify(dist, target, [], log=tmp_path / "probes.log")
    assert _running(marker) == []
    assert list(scratch.iterdir()) == []  # the run's temp folder is removed


def test_an_interrupted_wait_stops_the_probes(slow_probe):
    target, marker, scratch = slow_probe
    run = start_probes(target, ("layer_offset",))
    assert run.process is not None
    # Its environ can read empty while the child is still between its shell and `exec sleep`.
    pid = run.process.pid
    wait_until(lambda: _running(marker) == [pid], "the probe running", alive=run.process)
    with pytest.raises(KeyboardInterrupt), run:
        raise KeyboardInterrupt
    assert _running(marker) == []
    assert run.process.returncode is not None  # reaped, no zombie left
    assert list(scratch.iterdir()) == []


def test_a_timed_out_probe_is_killed_and_reads_unknown(slow_probe):
    target, marker, scratch = slow_probe
    run = start_probes(target, ("layer_offset",), timeout_s=0.5)
    results = run.wait()
    assert results["layer_offset"].status == UNKNOWN
    assert "timed out" in results["layer_offset"].evidence
    assert _running(marker) == []
    assert list(scratch.iterdir()) == []


def test_a_probe_run_that_finished_closes_quietly(slow_probe):
    """close() after wait() is a no-op: the reaped child is never signalled again."""
    _, _, scratch = slow_probe
    run = start_probes(ProbeTarget(python=Path("/bin/true")), ("layer_offset",))
    assert run.wait()["layer_offset"].status == UNKNOWN  # /bin/true writes no verdicts
    with run:
        pass
    assert run.process is not None and run.process.returncode == 0
    assert list(scratch.iterdir()) == []


def test_asking_a_failing_python_for_its_vllm_is_one_line(tmp_path):
    broken = _failing_python(tmp_path)
    with pytest.raises(VllmNotFoundError) as e:
        locate_with_python(broken)
    assert str(e.value) == (
        f"cannot ask {broken} for its vLLM: exit status 3: Fatal Python error: init_fs_encoding"
    )


def test_a_probe_runs_bytecode_goes_with_its_copy(tmp_path):
    """The probes' copy is new every run; the bytecode the child wrote for it under the
    pycache prefix is removed with it, not left to pile up in the cache."""
    pycache = tmp_path / "pycache"
    # The toolchain's interpreter has no vLLM: the child imports the copied probes
    # (writing their bytecode), then reports every probe unknown.
    run = start_probes(ProbeTarget(python=Path(sys.executable), pycache=pycache), ("fp8_kv",))
    copy = run.workdir
    assert run.wait()["fp8_kv"].status == UNKNOWN
    assert not copy.exists()
    assert pycache.is_dir(), "the child wrote no bytecode under the prefix at all"
    assert not (pycache / copy.relative_to(copy.anchor)).exists()


def _holding(path: Path) -> list[int]:
    """Live processes whose command line names ``path``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(path).encode() in cmdline and state != "Z":
            found.append(int(proc.name))
    return found


def test_sigterm_while_pip_installs_leaves_nothing_running_or_on_disk(tmp_path):
    """``pip --python`` runs pip again under the scratch virtualenv's interpreter: SIGTERM to
    verify must stop that grandchild too, and take the scratch install and pip's temp
    folders with it. The wheel is a FIFO nobody writes, so pip is installing until stopped."""
    wheel = tmp_path / "vllm-0.20.1-py3-none-any.whl"
    os.mkfifo(wheel)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "TOOLING_PROBE_PYTHON": sys.executable}
    verify_cmd = [sys.executable, "-m", "tooling", "--no-progress", "verify", "--wheel", str(wheel)]
    proc = subprocess.Popen(verify_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    left: list[int] = []
    try:
        # The verify itself, pip, and pip again under the scratch virtualenv's python.
        wait_until(lambda: len(_holding(wheel)) >= 3, "pip installing twice", alive=proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        left = _holding(wheel)
    finally:
        for pid in _holding(wheel):  # what a failing run left behind
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.decode() == "error: interrupted (SIGTERM)\n"
    assert left == []
    assert list(scratch.iterdir()) == []


def test_the_folders_of_a_killed_probe_run_are_removed_by_the_next(tmp_path, slow_probe):
    """SIGKILL runs no clean-up: a run's temp folder (and its bytecode under the prefix) is
    named for its process, and the next run removes it once that process is gone, never a
    live run's nor one it cannot tell (by age alone)."""
    target, marker, scratch = slow_probe
    cache = tmp_path / "cache"
    probe = ["probe", "--python", str(target.python), "--probe", "layer_offset"]
    killed = subprocess.Popen(
        [sys.executable, "-m", "tooling", "--cache-dir", str(cache), *probe],
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    # Its probe child runs: the folder is there. (Importing GitPython runs `git version`
    # before the folder is made: a child of the run, but not the probe.)
    wait_until(
        lambda: (
            any(scratch.glob(f"dflash-probes-{killed.pid}-*"))
            and not set(_running(marker)) <= {killed.pid}
        ),
        "the probe",
        alive=killed,
    )
    killed.kill()
    killed.wait()
    (left,) = scratch.glob(f"dflash-probes-{killed.pid}-*")
    pycache = cache / "pycache"
    bytecode = pycache / left.relative_to(left.anchor) / "child.pyc"
    bytecode.parent.mkdir(parents=True)
    bytecode.write_bytes(b"")
    live = scratch / f"dflash-verify-{os.getpid()}-abcdefgh"
    unknown = scratch / "dflash-probes-abcdefgh"  # no pid in its name: whose, cannot tell
    for folder in (live, unknown):
        folder.mkdir()
    next_run = start_probes(ProbeTarget(python=Path("/bin/true"), pycache=pycache), ("fp8_kv",))
    next_run.wait()
    assert sorted(scratch.iterdir()) == sorted([live, unknown])
    assert not bytecode.parent.exists()


def _env_with_dist(tmp_path: Path, record: bytes | None) -> tuple[Path, Path]:
    """A virtualenv whose site-packages holds a vLLM distribution (METADATA, and RECORD
    with ``record``, or none); its python and the RECORD's path."""
    import venv

    venv.EnvBuilder(with_pip=False).create(tmp_path / "env")
    python = tmp_path / "env" / "bin" / "python"
    (site,) = (tmp_path / "env" / "lib").glob("python*/site-packages")
    dist_info = site / "vllm-0.20.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.20.1\n")
    if record is not None:
        (dist_info / "RECORD").write_bytes(record)
    return python, dist_info / "RECORD"


@pytest.mark.parametrize(
    ("record", "why"),
    [
        (None, "is missing"),
        (b"", "is empty"),
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "is not text"),
        (b"vllm/__init__.py,sha256=abc,12\nnot a line\n", "line 2 is not a RECORD line"),
        (b"vllm/__init__.py,sha256=abc,twelve\n", "line 1 is not a RECORD line"),
    ],
)
def test_a_damaged_record_is_named_for_what_it_is(tmp_path, record, why):
    """Not "no vLLM installed", nor an error that does not name it: RECORD, and damage."""
    python, path = _env_with_dist(tmp_path, record)
    dist = locate_with_python(python)
    assert dist.site / dist.dist_info / "RECORD" == path
    with pytest.raises(VerifyIntegrityError) as e:
        read_record(dist)
    assert str(e.value).startswith(f"{path}: RECORD {why}")
    assert str(e.value).endswith(": this vLLM install is damaged")


def test_verify_of_an_install_whose_record_is_gone_says_so(tmp_path):
    python, path = _env_with_dist(tmp_path, None)
    result = subprocess.run(
        [sys.executable, "-m", "tooling", "verify", "--python", str(python)],
        capture_output=True,
        text=True,
        env={**os.environ, "TOOLING_PROBE_PYTHON": sys.executable},
    )
    assert result.returncode == VerifyIntegrityError.exit_code
    assert result.stderr == f"error: {path}: RECORD is missing: this vLLM install is damaged\n"
