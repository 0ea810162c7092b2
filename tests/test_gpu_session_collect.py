"""``ci/gpu/hybrid-session.sh collect``: what a GPU session's device command brings back
while the session's steps run, on real files here as on the host; and the production
smoke's variants as the session starts them."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

from tooling.pidfile import record

from .helpers import REPO_DIR, run_gpu_script
from .smoke_models import write_seed_pair


def test_collect_brings_reports_and_logs_in_separate_archives(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    smoke = work / "session" / "tiny" / "default"
    (smoke / "logs").mkdir(parents=True)
    (smoke / "models").mkdir()
    (smoke / "report.json").write_text("{}")
    (smoke / "logs" / "serve-dflash.log").write_text("INFO ready\n")
    (smoke / "models" / "model.safetensors").write_bytes(os.urandom(1 << 20))
    (work / "session" / "session.log").write_text("[02:24:38] tiny\n")
    (work / "session" / "tiny.txt").write_text("production smoke default: exit 0\n")
    cache = work / "trained" / "vllm-cache-plain"
    cache.mkdir(parents=True)
    (cache / "compile.log").write_text("x")
    (work / "trained" / "plain.log").write_text("INFO plain\n")
    (work / "speed" / "hybrid-pair").mkdir(parents=True)
    (work / "speed" / "hybrid-pair" / "dflash.log").write_text("INFO KV cache\n")
    out.mkdir()
    done = run_gpu_script("hybrid-session.sh", "collect", work=work, out=out)
    assert done.returncode == 0, done.stderr
    assert "[02:24:38] tiny" in done.stdout
    texts = (out / "texts.txt").read_text()
    assert "== session/tiny.txt\nproduction smoke default: exit 0" in texts

    def names(archive: str) -> set[str]:
        with tarfile.open(out / archive) as tar:
            return set(tar.getnames())

    assert names("reports.tgz") == {"session/tiny/default/report.json", "session/tiny.txt"}
    # The models and the compile caches never: no command could bring them back.
    assert names("logs.tgz") == {
        "session/session.log",
        "session/tiny/default/logs/serve-dflash.log",
        "trained/plain.log",
        "speed/hybrid-pair/dflash.log",
    }


def test_the_pair_variant_smokes_the_pair_as_a_user_passes_it(tmp_path: Path) -> None:
    """``production-smoke.sh pair``: the folders in PAIR as --target and --drafter, no
    generated pair (its plan has no models step), K = 15; its plan printed by --dry-run."""
    pair = tmp_path / "pair"
    write_seed_pair(pair / "target", pair / "drafter", 55 * 10**9, shards=4)
    before = {p: p.stat().st_mtime_ns for p in pair.rglob("*")}
    out = tmp_path / "out"
    done = run_gpu_script(
        "production-smoke.sh",
        "pair",
        work=tmp_path / "work",
        out=out,
        PAIR=str(pair),
        PATCHED_SITE=str(tmp_path / "site"),
        SMOKE_ARGS="--dry-run --gpus 1x139",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "production smoke pair: exit 0" in done.stdout
    plan = json.loads((out / "pair.json").read_text())["plan"]
    assert (plan["target"], plan["drafter"]) == (str(pair / "target"), str(pair / "drafter"))
    assert plan["engine"]["num_speculative_tokens"] == 15
    assert "models" not in [s["step"] for s in plan["steps"]]
    # The user's folders are read, never written.
    assert {p: p.stat().st_mtime_ns for p in pair.rglob("*")} == before


@contextlib.contextmanager
def _process() -> Iterator[subprocess.Popen]:
    """A process that stands in for a running session's, killed on leaving."""
    process = subprocess.Popen(["sleep", "600"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def _session(work: Path, process: subprocess.Popen) -> None:
    """A session's files as ``start`` leaves them, its smoke two waves in; ``process`` (still
    running) stands in for the session's."""
    session = work / "session"
    (session / "seed-full-pair" / "pair").mkdir(parents=True)
    (session / "session.log").write_text("[08:27:37] seed-full-pair\n")
    record(session / "background.pid", process.pid)
    (session / "seed-full-pair" / "pair" / "report.json").write_text('{"partial": true}')
    (session / "seed-full-pair" / "pair.err").write_text(
        "[smoke] serve with DFlash ...\nINFO noise\n[smoke] in-process engine (engine) ...\n"
    )


def test_wait_returns_once_the_session_has_ended_and_brings_back_what_ran(
    tmp_path: Path,
) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    ended = subprocess.Popen(["sleep", "600"])
    _session(work, ended)
    ended.kill()
    ended.wait()
    # The limit is far past the hang guard: only the session's end can have let it return.
    done = run_gpu_script("hybrid-session.sh", "wait", "100000", work=work, out=out)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-3:] == [
        "[smoke] serve with DFlash ...",
        "[smoke] in-process engine (engine) ...",
        "session: ended",
    ]
    assert "[08:27:37] seed-full-pair" in done.stdout
    with tarfile.open(out / "reports.tgz") as tar:
        assert "session/seed-full-pair/pair/report.json" in tar.getnames()
    assert "[08:27:37] seed-full-pair" in (out / "collect.txt").read_text()


def test_wait_on_a_session_still_running_says_so_and_still_collects(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    with _process() as running:
        _session(work, running)
        done = run_gpu_script("hybrid-session.sh", "wait", "0", work=work, out=out)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "session: running"
    assert (out / "reports.tgz").is_file() and (out / "logs.tgz").is_file()


def test_wait_refuses_a_limit_that_is_not_seconds_and_a_folder_with_no_session(
    tmp_path: Path,
) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    bad = run_gpu_script("hybrid-session.sh", "wait", "9m", work=work, out=out)
    assert (bad.returncode, bad.stderr.count("\n")) == (2, 1)
    assert "SECONDS must be a whole number (at most 9 digits), not '9m'" in bad.stderr
    none = run_gpu_script("hybrid-session.sh", "wait", "5", work=work, out=out)
    assert (none.returncode, none.stderr.count("\n")) == (2, 1)
    assert "background.pid: no session was started here" in none.stderr
    assert list(out.iterdir()) == []


def test_a_second_start_while_a_session_runs_is_refused_before_it_installs(
    tmp_path: Path,
) -> None:
    work = tmp_path / "work"
    running = subprocess.Popen(["sleep", "600"])
    try:
        _session(work, running)
        before = sorted(p.relative_to(work) for p in work.rglob("*"))
        done = run_gpu_script("hybrid-session.sh", "start", str(tmp_path / "parts"), work=work)
    finally:
        running.kill()
        running.wait()
    assert done.returncode == 2
    assert (
        done.stderr
        == f"error: {work}/session: a session is already running (pid {running.pid}): wait for it\n"
    )
    # Nothing joined, installed or started: the running session's files are as they were.
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == before


def test_a_steps_logged_status_is_its_smokes(tmp_path: Path) -> None:
    """The session's log line for a step is the exit status of the step's smoke: the session
    runs as on the host, its GPU work (the engines' builds, the pair's draw on the GPU, the
    smoke) stood in for by a python3 whose children exit as that work would; the session
    itself runs in this interpreter."""
    stand_in = tmp_path / "bin" / "python3"
    stand_in.parent.mkdir()
    stand_in.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        f'  *"host --script hybrid-session.sh"*) exec {sys.executable} "$@" ;;\n'
        '  *"host smoke"*) echo "production smoke pair: exit 17"; exit 17 ;;\n'
        "esac\n"
        "exit 0\n"
    )
    stand_in.chmod(0o755)
    work = tmp_path / "work"
    (work / "session").mkdir(parents=True)
    done = subprocess.run(
        [
            "bash",
            str(REPO_DIR / "ci" / "gpu" / "hybrid-session.sh"),
            "background",
            str(tmp_path),
            "seed-full-pair",
        ],
        env={**os.environ, "WORK": str(work), "PATH": f"{stand_in.parent}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    marks = [line.split("] ", 1)[1] for line in done.stdout.splitlines()]
    assert marks[-2].startswith("the pair drawn on the GPU: exit 0 in ")
    assert marks[-1] == "seed-full-pair: exit 17"
    assert "production smoke pair: exit 17" in (work / "session" / "seed-full-pair.txt").read_text()


def test_wait_returns_once_the_pair_is_written_and_says_to_export_it(tmp_path: Path) -> None:
    """The pair's export is calls of their own while the steps run: a wait that sees the
    recipe write the pair returns then, whatever its limit, and says so."""
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    pair = work / "hybrid-pair"
    # Written a moment after the wait begins, as the recipe writes it last.
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import pathlib, sys, time; time.sleep(3); p = pathlib.Path(sys.argv[1]); "
            "p.mkdir(parents=True); (p / 'summary.json').write_text('{}')",
            str(pair),
        ]
    )
    with _process() as running:
        _session(work, running)
        done = run_gpu_script("hybrid-session.sh", "wait", "100000", work=work, out=out)
    writer.wait()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == [
        "pair: written and not exported; `trained-hybrid.sh export-pair 0`, 1, ... now",
        "session: running",
    ]
    # Once its parts are made, the wait runs to its limit and no longer asks.
    (work / "pair-parts").mkdir()
    with _process() as again:
        record(work / "session" / "background.pid", again.pid)
        done = run_gpu_script("hybrid-session.sh", "wait", "0", work=work, out=out)
    assert done.stdout.splitlines()[-1] == "session: running"
    assert "pair: written" not in done.stdout
