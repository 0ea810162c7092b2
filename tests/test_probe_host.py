"""One interpreter start for the probe runs of one release (``tooling.probing.host``).

The fast tests run the toolchain's own interpreter against a stand-in ``vllm``
package: the probes then fail to import vLLM's modules and read unknown, with the
exception as evidence, which is enough to compare a forked run with a fresh one.
On the real 0.20.1 tree, forked runs give the verdicts test_apply checks (the
session's patched tree is probed through a host) and share the probe cache with
fresh runs (test_probe_cache).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
from pathlib import Path

import pytest

import tooling.probing.host
from tooling.fetching.upstream import Upstream
from tooling.patching.apply import ApplyOptions, apply_series
from tooling.probing import (
    UNKNOWN,
    ProbeHost,
    ProbeResult,
    ProbeTarget,
    run_probes,
    start_probes,
)

from .counting import counting_python, started

PROBE = ("layer_offset",)


def stand_in(root: Path, init: str = '__version__ = "0.0.stand-in"\n') -> Path:
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(init)
    return root


def answer(result: ProbeResult) -> tuple[str, str]:
    """A verdict without the run's own folder (the probes' copy), which names each run."""
    return result.status, re.sub(r"/\S*/dflash-probes-[^/]+/", "", result.evidence)


def gone(pid: int) -> bool:
    """No process of ``pid``'s group is left (a forked run included)."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def interpreter(tmp_path):
    return counting_python(tmp_path, Path(sys.executable))


def target_of(root: Path, python: Path, tmp_path: Path) -> ProbeTarget:
    return ProbeTarget(python=python, root=root, pycache=tmp_path / "pycache")


def test_runs_of_one_host_share_one_start_and_answer_as_a_fresh_run(tmp_path, interpreter):
    python, starts = interpreter
    target = target_of(stand_in(tmp_path / "tree"), python, tmp_path)
    fresh = run_probes(target, PROBE)[PROBE[0]]
    assert started(starts) == 1
    with ProbeHost(python, target.pycache) as host:
        runs = [run_probes(target, PROBE, host=host)[PROBE[0]] for _ in range(2)]
        assert (host.starts, host.forks) == (1, 2)
        pid = host.pid
    assert started(starts) == 2
    assert answer(fresh) == (
        UNKNOWN,
        "ModuleNotFoundError at dflash_probes/_harness.py:34: No module named 'vllm.platforms'",
    )
    assert [answer(r) for r in runs] == [answer(fresh)] * 2
    assert pid is not None and gone(pid)


def test_a_tree_that_holds_a_preloaded_package_gets_its_own_interpreter(tmp_path, interpreter):
    python, starts = interpreter
    root = stand_in(tmp_path / "tree")
    (root / "torch").mkdir()
    target = target_of(root, python, tmp_path)
    with ProbeHost(python, target.pycache) as host:
        got = run_probes(target, PROBE, host=host)[PROBE[0]]
        assert (host.starts, host.forks) == (0, 0)
    assert got.status == UNKNOWN and started(starts) == 1


@pytest.mark.parametrize(
    "name",
    [
        "VLLM_ATTENTION_BACKEND",  # read by the probed code
        "HOME",  # read by the interpreter as it starts: the user's site folder
    ],
)
def test_a_changed_environment_gets_its_own_interpreter(tmp_path, interpreter, monkeypatch, name):
    python, starts = interpreter
    target = target_of(stand_in(tmp_path / "tree"), python, tmp_path)
    with ProbeHost(python, target.pycache) as host:
        run_probes(target, PROBE, host=host)
        monkeypatch.setenv(name, str(tmp_path / "changed"))
        run_probes(target, PROBE, host=host)
        assert (host.starts, host.forks) == (1, 1)
    assert started(starts) == 2


def test_a_variable_the_probed_code_does_not_read_is_forked_and_reaches_the_run(
    tmp_path, interpreter, monkeypatch
):
    """pytest's own PYTEST_CURRENT_TEST changes with every test: such a variable must not
    cost a start, and the forked run must still see its own value."""
    python, starts = interpreter
    mark = 'import os\nraise RuntimeError(os.environ.get("DFLASH_TEST_MARK"))\n'
    target = target_of(stand_in(tmp_path / "tree", mark), python, tmp_path)
    evidence = []
    with ProbeHost(python, target.pycache) as host:
        for value in ("first", "second"):
            monkeypatch.setenv("DFLASH_TEST_MARK", value)
            evidence.append(run_probes(target, PROBE, host=host)[PROBE[0]].evidence)
        assert (host.starts, host.forks) == (1, 2)
    assert started(starts) == 1
    assert evidence == [f"cannot import vllm: RuntimeError: {v}" for v in ("first", "second")]


# Waits out a real timeout (seconds of wall time): the slow tier.
@pytest.mark.slow
def test_a_run_past_its_timeout_is_stopped_with_the_server(tmp_path, interpreter):
    python, starts = interpreter
    hangs = target_of(
        stand_in(tmp_path / "hangs", "import time\ntime.sleep(120)\n"), python, tmp_path
    )
    with ProbeHost(python, hangs.pycache) as host:
        got = run_probes(hangs, PROBE, host=host, timeout_s=3)[PROBE[0]]
        assert got.status == UNKNOWN and "timed out after 3s" in got.evidence
        assert host.pid is None
        # The host is stopped: a later run starts an interpreter of its own, and answers.
        quick = target_of(stand_in(tmp_path / "quick"), python, tmp_path)
        assert run_probes(quick, PROBE, host=host)[PROBE[0]].status == UNKNOWN
        assert (host.starts, host.forks) == (1, 1)
    assert started(starts) == 2


def test_a_server_killed_from_outside_leaves_the_run_to_a_fresh_interpreter(tmp_path, interpreter):
    python, starts = interpreter
    target = target_of(stand_in(tmp_path / "tree"), python, tmp_path)
    with ProbeHost(python, target.pycache) as host:
        first = run_probes(target, PROBE, host=host)[PROBE[0]]
        pid = host.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        again = run_probes(target, PROBE, host=host)[PROBE[0]]
        assert host.pid is None and gone(pid)
    assert answer(again) == answer(first)
    assert started(starts) == 2


def test_a_server_whose_preloads_start_a_thread_does_not_fork(tmp_path, interpreter, monkeypatch):
    python, starts = interpreter
    extra = tmp_path / "site"
    extra.mkdir()
    (extra / "threader.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(extra))
    monkeypatch.setattr(tooling.probing.host, "PRELOAD", ("threader",))
    target = target_of(stand_in(tmp_path / "tree"), python, tmp_path)
    with ProbeHost(python, target.pycache) as host:
        got = run_probes(target, PROBE, host=host)[PROBE[0]]
        assert host.pid is None
    assert answer(got)[1].endswith("No module named 'vllm.platforms'"), got.evidence
    assert started(starts) == 2  # the server, then the run's own interpreter


def test_one_release_is_probed_from_one_start(tmp_path, interpreter, catalog, series):
    """``apply_series`` probes the base and the patched tree from one interpreter start
    (here the series conflicts on the stand-in tree, and the probes read unknown)."""
    python, starts = interpreter
    upstream = Upstream(catalog.get("0.20.1"), "pypi", stand_in(tmp_path / "src"), None)
    options = ApplyOptions(probe_python=python, pycache=tmp_path / "pycache", keep_going=True)
    report = apply_series(upstream, series, tmp_path / "w", options)
    assert started(starts) == 1
    for outcome in report.outcomes:
        assert outcome.probe_before["status"] == UNKNOWN, outcome.probe_before
        assert outcome.probe_after["status"] == UNKNOWN, outcome.probe_after


def test_an_interpreter_that_does_not_start_is_named_by_the_run(tmp_path):
    missing = tmp_path / "no-such-python"
    target = target_of(stand_in(tmp_path / "tree"), missing, tmp_path)
    with ProbeHost(missing, target.pycache) as host:
        got = run_probes(target, PROBE, host=host)[PROBE[0]]
        assert host.pid is None and host.forks == 0
    assert got.status == UNKNOWN
    assert got.evidence == f"cannot start {missing}: No such file or directory"


def test_a_failure_while_starting_leaves_no_copy_behind(tmp_path, interpreter, monkeypatch):
    python, _ = interpreter
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    target = target_of(stand_in(tmp_path / "tree"), python, tmp_path)

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    with ProbeHost(python, target.pycache) as host:
        monkeypatch.setattr(host, "start", interrupted)
        with pytest.raises(KeyboardInterrupt):
            start_probes(target, PROBE, host=host)
    assert list(scratch.iterdir()) == []
