"""The GPU host's scripts (``ci/gpu``) under hostile or careless input, run here as on the
host (``helpers.run_gpu_script``): no value from the environment is evaluated by the shell,
and every script refuses what its usage line does not name before it does anything."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tooling.paths import REPO_DIR
from tooling.pidfile import record, start_time
from tooling.smoke_summary import main as smoke_summary

from .helpers import HANG_GUARD_S, run_gpu_script


def test_time_limit_is_never_evaluated_by_the_shell(tmp_path: Path) -> None:
    """bash arithmetic runs the command substitution in an array subscript: the value is
    refused as what it is, a setting that is not a number, before anything runs."""
    marker, out = tmp_path / "PWNED", tmp_path / "out"
    done = run_gpu_script(
        "production-smoke.sh",
        "default",
        work=tmp_path / "work",
        out=out,
        PATCHED_SITE=str(tmp_path / "site"),
        TIME_LIMIT=f"PATH[$(touch {marker})]",
    )
    assert not marker.exists()
    assert (done.returncode, done.stderr) == (
        2,
        "error: production-smoke.sh: TIME_LIMIT must be a whole number (at most 9 digits), "
        f"not 'PATH[$(touch {marker})]'\n",
    )
    assert not out.exists() and not (tmp_path / "work").exists()


GPU = REPO_DIR / "ci" / "gpu"
#: Sourced by the others, never run.
SOURCED = {"env.sh", "args.sh"}

#: Every script, with arguments its usage line does not name: each must be refused before
#: anything runs (``host-setup.sh P bogus`` ran as ``all``, ``trained-hybrid.sh bogus`` as a
#: CALL, ``hybrid-proof.sh 4`` started engines for no call).
UNKNOWN_ARGUMENTS = [
    ("acceptance.sh", ("bogus",)),
    ("gpu-fuzz.sh", ()),
    ("gpu-fuzz.sh", ("bogus", "seed")),
    ("gpu-fuzz.sh", ("patched", "bogus")),
    ("gpu-fuzz.sh", ("patched", "seed", "more")),
    ("host-setup.sh", ()),
    ("host-setup.sh", ("P", "bogus")),
    ("host-setup.sh", ("P", "all", "more")),
    ("hybrid-proof.sh", ()),
    ("hybrid-proof.sh", ("4",)),
    ("hybrid-session.sh", ()),
    ("hybrid-session.sh", ("bogus",)),
    ("hybrid-session.sh", ("start", "P", "bogus")),
    ("hybrid-session.sh", ("collect", "more")),
    ("hybrid-session.sh", ("wait", "5", "more")),
    ("make-parts.sh", ()),
    ("make-parts.sh", ("OUT", "62914560", "more")),
    ("pair-parts.sh", ()),
    ("pair-parts.sh", ("OUT", "62914560", "DIR")),
    ("pair-parts.sh", ("OUT", "--")),
    ("production-smoke.sh", ()),
    ("production-smoke.sh", ("bogus",)),
    ("production-smoke.sh", ("default", "more")),
    ("production-smoke-all.sh", ("bogus",)),
    ("smoke-pair.sh", ("bogus",)),
    ("train-background.sh", ("bogus",)),
    ("trained-hybrid.sh", ()),
    ("trained-hybrid.sh", ("bogus",)),
    ("trained-hybrid.sh", ("1", "more")),
    ("trained-hybrid.sh", ("export-pair",)),
    ("trained-hybrid.sh", ("import-pair",)),
    ("trained-hybrid.sh", ("collect", "more")),
]


def _usage_line(script: str) -> str:
    text = (GPU / script).read_text()
    start = text.index('. "$here/args.sh" "') + len('. "$here/args.sh" "')
    return text[start : text.index('"', start)]


def test_every_script_is_in_the_table_of_unknown_arguments() -> None:
    scripts = {p.name for p in GPU.glob("*.sh")} - SOURCED
    assert {s for s, _ in UNKNOWN_ARGUMENTS} == scripts


@pytest.mark.parametrize(("script", "args"), UNKNOWN_ARGUMENTS)
def test_every_script_refuses_unknown_arguments_with_its_usage_line(
    tmp_path: Path, script: str, args: tuple[str, ...]
) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    done = run_gpu_script(
        script,
        *args,
        work=work,
        out=out,
        cwd=tmp_path,
        PATCHED_SITE=str(tmp_path / "site"),
        STOCK_SITE=str(tmp_path / "stock"),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: {script}: ") and done.stderr.count("\n") == 1
    assert done.stderr.endswith(f" ({_usage_line(script)})\n"), done.stderr
    # Refused before anything: nothing made, nothing run.
    assert done.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not any(out.iterdir())


#: Every number a script reads from the environment or its arguments, given an expression
#: whose evaluation would leave a file: each is refused as a value that is not a number.
NUMBERS = [
    ("production-smoke.sh", ("default",), "TIME_LIMIT"),
    ("production-smoke-all.sh", (), "TIME_LIMIT"),
    ("hybrid-proof.sh", ("1",), "TIME_LIMIT"),
    ("trained-hybrid.sh", ("1",), "TIME_LIMIT"),
    ("trained-hybrid.sh", ("wait",), "WAIT_S"),
    ("trained-hybrid.sh", ("chain",), "CALLS"),
    ("acceptance.sh", (), "WAIT_S"),
    ("make-parts.sh", ("OUT", "{value}"), "PART_SIZE_BYTES"),
    ("pair-parts.sh", ("OUT", "{value}", "--", "."), "PART_SIZE_BYTES"),
    ("hybrid-session.sh", ("wait", "{value}"), "SECONDS"),
    ("trained-hybrid.sh", ("export-pair", "{value}"), "CALL"),
]


@pytest.mark.parametrize(("script", "args", "name"), NUMBERS)
@pytest.mark.parametrize("shape", ["x[$(touch {marker})]", "$(touch {marker})", "1+1", "-5", "abc"])
def test_no_script_evaluates_a_number_it_is_given(
    tmp_path: Path, script: str, args: tuple[str, ...], name: str, shape: str
) -> None:
    marker = tmp_path / "PWNED"
    value = shape.format(marker=marker)
    given = [a.format(value=value) for a in args]
    env = {} if "{value}" in "".join(args) else {name: value}
    done = run_gpu_script(
        script,
        *given,
        work=tmp_path / "work",
        out=tmp_path / "out",
        cwd=tmp_path,
        PATCHED_SITE=str(tmp_path / "site"),
        STOCK_SITE=str(tmp_path / "stock"),
        **env,
    )
    assert not marker.exists()
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: {script}: {name}") and done.stderr.count("\n") == 1
    assert f"not '{value}'" in done.stderr, done.stderr


@pytest.mark.slow
def test_pair_parts_writes_a_relative_out_dir_where_it_was_started(tmp_path: Path) -> None:
    """Relative OUT_DIR and DIRs are the caller's: the script wrote into the repository."""
    host = tmp_path / "host"
    (host / "hybrid-pair").mkdir(parents=True)
    (host / "hybrid-pair" / "summary.json").write_text("{}")
    first = tmp_path / "first"
    first.mkdir()
    exported = run_gpu_script("trained-hybrid.sh", "export-pair", "0", work=host, out=first)
    assert exported.returncode == 0, exported.stderr
    done = run_gpu_script("pair-parts.sh", "carry", "--", "first", work=host, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not (REPO_DIR / "carry").exists()
    assert sorted(p.name for p in (tmp_path / "carry").iterdir()) == [
        "SHA256SUMS",
        "hybrid-pair.tar.part-000",
        "join.py",
    ]


def test_a_missing_join_py_is_named(tmp_path: Path) -> None:
    """Python's "can't open file" named a temp path; the folder given is what lacks it."""
    parts = tmp_path / "parts"
    parts.mkdir()
    done = run_gpu_script("host-setup.sh", str(parts), work=tmp_path / "work")
    assert (done.returncode, done.stderr) == (
        2,
        f"error: host-setup.sh: {parts}/join.py: no such file (PARTS_DIR holds the parts "
        "make-parts.sh made)\n",
    )
    done = run_gpu_script("pair-parts.sh", str(tmp_path / "o"), "--", str(parts), work=tmp_path)
    assert (done.returncode, done.stderr) == (
        2,
        f"error: pair-parts.sh: no join.py in {parts} (the first export's folder has it)\n",
    )
    done = run_gpu_script("trained-hybrid.sh", "import-pair", str(parts), work=tmp_path / "w")
    assert (done.returncode, done.stderr) == (
        2,
        f"error: trained-hybrid.sh: {parts}/join.py: no such file (PARTS holds the pair's parts)\n",
    )
    assert not (tmp_path / "work").exists() and not (tmp_path / "w" / "hybrid-pair").exists()


def test_a_missing_setting_is_named_with_what_it_names(tmp_path: Path) -> None:
    """bash's own words were "OUT: parameter null or not set"."""
    done = run_gpu_script(
        "production-smoke.sh", "default", work=tmp_path, PATCHED_SITE=str(tmp_path)
    )
    assert (done.returncode, done.stderr) == (
        2,
        "error: production-smoke.sh: OUT is not set: the folder reports and logs go to\n",
    )
    done = run_gpu_script("trained-hybrid.sh", "collect", work=tmp_path)
    assert (done.returncode, done.stderr) == (
        2,
        "error: trained-hybrid.sh: OUT is not set: the folder this command brings back\n",
    )


def test_make_parts_checks_its_part_size_before_it_makes_the_bundle(tmp_path: Path) -> None:
    """The size was read only after minutes of resolving and downloading the bundle; an
    empty cache here would have failed first, on the wheel it lacks."""
    done = run_gpu_script(
        "make-parts.sh",
        "parts",
        "abc",
        work=tmp_path,
        cwd=tmp_path,
        VLLM_DFLASH_CACHE=str(tmp_path / "empty-cache"),
    )
    assert (done.returncode, done.stderr) == (
        2,
        "error: make-parts.sh: PART_SIZE_BYTES must be a whole number (at most 9 digits), "
        "not 'abc'\n",
    )
    small = run_gpu_script("make-parts.sh", "parts", "1", work=tmp_path, cwd=tmp_path)
    assert (small.returncode, small.stderr) == (
        2,
        "error: make-parts.sh: PART_SIZE_BYTES 1 is under 1 MiB (1048576)\n",
    )
    assert not (tmp_path / "parts").exists()


def test_a_smoke_that_wrote_no_json_is_one_line_then_its_own_last_lines(tmp_path: Path) -> None:
    """A site that breaks the toolchain's import: the smoke writes nothing on stdout, and
    the script's reader printed a JSONDecodeError traceback over the smoke's own error."""
    site = tmp_path / "site"
    (site / "click").mkdir(parents=True)
    (site / "click" / "__init__.py").write_text("raise ImportError('a broken site')\n")
    out = tmp_path / "out"
    done = run_gpu_script(
        "production-smoke.sh",
        "default",
        work=tmp_path / "w",
        out=out,
        PATCHED_SITE=str(site),
        SHARED_GPU="1",
    )
    assert done.returncode == 1
    assert done.stderr == (
        f"error: {out}/default.json: the smoke wrote no JSON (its last lines follow)\n"
    )
    assert done.stdout.splitlines()[0].startswith("production smoke default: exit 1 in ")
    assert done.stdout.splitlines()[-1] == "ImportError: a broken site"
    assert "JSONDecodeError" not in done.stdout + done.stderr


def _running_session_file(work: Path, text: str) -> None:
    session = work / "session"
    session.mkdir(parents=True)
    (session / "background.pid").write_text(text)
    (session / "session.log").write_text("[08:27:37] seed\n")


def test_wait_does_not_take_another_process_for_the_session(tmp_path: Path) -> None:
    """The session has ended and the kernel has given its pid to another process: a bare
    pid said "running" then. A record now holds the process's start time too, and one
    whose pid now runs a process started at another time is a session that ended."""
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    other = subprocess.Popen(["sleep", "600"])
    try:
        started = start_time(other.pid)
        assert started is not None
        _running_session_file(work, f"{other.pid}\n")
        bare = run_gpu_script("hybrid-session.sh", "wait", "0", work=work, out=out)
        (work / "session" / "background.pid").write_text(f"{other.pid} {int(started) - 1}\n")
        reused = run_gpu_script("hybrid-session.sh", "wait", "0", work=work, out=out)
        record(work / "session" / "background.pid", other.pid)
        itself = run_gpu_script("hybrid-session.sh", "wait", "0", work=work, out=out)
    finally:
        other.kill()
        other.wait()
    assert (bare.returncode, bare.stderr) == (
        2,
        f"error: {work}/session/background.pid: not a record of a process (pid and start "
        f"time): '{other.pid}\\n'\n",
    )
    assert "session: running" not in bare.stdout
    assert reused.returncode == 0, reused.stderr
    assert reused.stdout.splitlines()[-1] == "session: ended"
    assert itself.stdout.splitlines()[-1] == "session: running"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "the smoke wrote no JSON (its last lines follow)"),
        ('{"checks": [', "not the smoke's JSON ("),
        ('{"checks": "1 aux PASS"}', "checks '1 aux PASS' is not a list of tables"),
        (
            '{"checks": [{"number": "1", "id": "a", "status": "pass", "evidence": ""}]}',
            ": checks[0]: number '1' is not a whole number",
        ),
        ('{"checks": [{"number": 1}]}', ": checks[0]: missing key 'id'"),
        ('{"summary": 5}', "summary 5 is not a string"),
    ],
)
def test_the_hosts_check_table_names_a_document_that_is_not_a_smokes(
    tmp_path: Path, text: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    document = tmp_path / "default.json"
    document.write_text(text)
    code = smoke_summary([str(document)])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.startswith(f"error: {document}") and why in err, err
    assert err.count("\n") == 1


def test_the_hosts_check_table_of_a_smokes_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = tmp_path / "default.json"
    check = {"number": 1, "id": "aux_layers", "status": "pass", "evidence": "x" * 300}
    document.write_text(json.dumps({"checks": [check], "summary": "1 of 1 checks pass"}))
    assert smoke_summary([str(document)]) == 0
    assert capsys.readouterr().out == f" 1 aux_layers       pass  {'x' * 200}\n1 of 1 checks pass\n"


def test_join_py_refuses_what_its_usage_line_does_not_name(tmp_path: Path) -> None:
    """The bundle's join.py, the one script the GPU host runs from the parts themselves: an
    extra argument was ignored, a folder without SHA256SUMS a traceback."""
    join = REPO_DIR / "tooling" / "release" / "bundle_files" / "join.py"
    shutil.copy(join, tmp_path / "join.py")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(tmp_path / "join.py"), *args],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )

    for args in (("a", "b"), ("--force",)):
        done = run(*args)
        assert (done.returncode, done.stderr) == (
            2,
            f"join.py: unknown argument {args[-1]!r} (usage: python3 join.py [DEST])\n",
        )
    done = run(str(tmp_path / "dest"))
    assert done.returncode == 1 and done.stderr.startswith(
        f"join.py: cannot read {tmp_path / 'SHA256SUMS'}: "
    )
    assert "Traceback" not in done.stderr and not (tmp_path / "dest").exists()


def _make_parts_for(tmp_path: Path, base: str) -> subprocess.CompletedProcess[str]:
    """``BASE=base make-parts.sh parts`` on an empty cache."""
    empty = str(tmp_path / "empty-cache")
    return run_gpu_script(
        "make-parts.sh", "parts", work=tmp_path, cwd=tmp_path, BASE=base, VLLM_DFLASH_CACHE=empty
    )


def test_make_parts_refuses_a_base_that_is_not_pinned_before_it_makes_anything(
    tmp_path: Path,
) -> None:
    """BASE names the release the parts carry; one that bases.toml does not pin is one line
    naming it, before any resolving or download."""
    done = _make_parts_for(tmp_path, "0.99.0")
    assert done.returncode == 4, done.stderr
    assert done.stderr.count("\n") == 1 and "'0.99.0'" in done.stderr, done.stderr
    assert not (tmp_path / "parts").exists()


def test_make_parts_for_another_base_asks_for_that_releases_artifacts(tmp_path: Path) -> None:
    """BASE=0.34.0 looks for 0.34.0's official wheel and sdist, and says how to get them;
    its bundle leaves out what the host's pip freeze has at the same versions, since 0.34.0
    pins another torch than the host's. So does the default base's: the host's image moved
    past 0.20.1's lock (aiohttp, numpy, transformers, ...), and a bundle that left those
    out by name alone did not install there."""
    from tooling.host.parts import HOST_FREEZE, PartsSettings

    done = _make_parts_for(tmp_path, "0.34.0")
    assert done.returncode != 0
    assert "no vllm-0.34.0 wheel and sdist (tooling fetch --base 0.34.0" in done.stderr
    assert PartsSettings(base="0.34.0").present == HOST_FREEZE
    assert PartsSettings().present == HOST_FREEZE
    assert "torch==2.11.0" in HOST_FREEZE.read_text().splitlines()
