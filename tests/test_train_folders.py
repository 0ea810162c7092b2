"""``tooling train``'s run folder under hostile or careless input: a folder of the user's is
never replaced, and a summary that is not a run's is one line naming the file and the key,
whether the command line or the recipe's own entry (``python -m tooling.trainer``, which
the GPU host runs) reads it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import TrainSettingsError
from tooling.paths import REPO_DIR

from .helpers import HANG_GUARD_S, wait_until


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }


def _train(*args: str) -> Any:
    # /bin/false would answer nothing: a refusal must come before it is started.
    return CliRunner().invoke(main, ["train", "--python", "/bin/false", "--preset", "smoke", *args])


def _recipe_entry(*args: str) -> subprocess.CompletedProcess[str]:
    """The recipe's own entry, as the GPU host's scripts start it, in this interpreter (no
    torch: a folder refused is refused before the recipe looks for it)."""
    return subprocess.run(
        [sys.executable, "-m", "tooling.trainer", "train", "--preset", "smoke", *args],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _users_run_lookalike(folder: Path) -> None:
    for sub in ("target", "drafter"):
        (folder / sub).mkdir(parents=True)
        (folder / sub / "notes.txt").write_text(f"my own {sub}, keep it")


def test_a_folder_with_a_runs_names_but_no_finished_run_is_refused_and_kept(
    tmp_path: Path,
) -> None:
    """The user's own target/ and drafter/: the run replaced the folder whole, notes and
    all, without --force or a word."""
    mine = tmp_path / "U"
    _users_run_lookalike(mine)
    before = _snapshot(mine)
    message = (
        f"error: --out-dir {mine}: holds drafter, target but no finished run (a run writes "
        "its summary.json last), and a run replaces the folder whole: give a new or empty "
        "folder\n"
    )
    result = _train("--out-dir", str(mine))
    assert (result.exit_code, result.stderr) == (TrainSettingsError.exit_code, message)
    done = _recipe_entry("--out-dir", str(mine))
    assert (done.returncode, done.stderr) == (TrainSettingsError.exit_code, message)
    assert _snapshot(mine) == before


def _good_summary() -> dict[str, Any]:
    return {
        "output_dir": "/x",
        "recipe_digest": "abc",
        "wall_s": 1.5,
        "target": {"heldout_loss": 2.0},
        "reference": {"mean_acceptance_length": 3.0, "acceptance_per_position": [0.9, 0.5]},
    }


def _with(key: str, value: Any) -> str:
    summary = _good_summary()
    table, _, inner = key.partition(".")
    if inner:
        summary[table][inner] = value
    elif value is _DROP:
        del summary[table]
    else:
        summary[table] = value
    return json.dumps(summary)


_DROP = object()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "not a run's summary (not JSON: "),
        ("[1, 2]", "is [1, 2], not a table of keys"),
        (_with("recipe_digest", _DROP), "missing key 'recipe_digest'"),
        (_with("recipe_digest", 7), "recipe_digest 7 is not a string"),
        (_with("output_dir", None), "output_dir None is not a string"),
        (_with("wall_s", "fast"), "wall_s 'fast' is not a finite number"),
        (_with("target", [2.0]), "target [2.0] is not a table"),
        (_with("target.heldout_loss", "2"), ": target: heldout_loss '2' is not a finite number"),
        (
            _with("reference.acceptance_per_position", "0.9,0.5"),
            ": reference: acceptance_per_position '0.9,0.5' is not a list of numbers",
        ),
        (
            _with("reference.mean_acceptance_length", True),
            ": reference: mean_acceptance_length True is not a finite number",
        ),
        (_with("wall_s", float("nan")), "wall_s nan is not a finite number"),
        ("x" * (2 << 20), "over 1048576 bytes: not a run's summary"),
    ],
)
def test_a_summary_that_is_not_a_runs_is_one_line_naming_file_and_key(
    tmp_path: Path, text: str, why: str
) -> None:
    """It gave the recipe a traceback (exit 1 in the child, 22 here): now it is refused
    before any child starts, the folder kept."""
    run = tmp_path / "run"
    (run / "target").mkdir(parents=True)
    (run / "drafter").mkdir()
    (run / "summary.json").write_text(text)
    result = _train("--out-dir", str(run))
    assert result.exit_code == TrainSettingsError.exit_code, result.stderr
    assert result.stderr.startswith(f"error: {run / 'summary.json'}")
    assert why in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert (run / "summary.json").read_text() == text


def test_the_recipes_own_entry_names_a_garbage_summary_too(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "target").mkdir(parents=True)
    (run / "drafter").mkdir()
    (run / "summary.json").write_text("garbage")
    done = _recipe_entry("--out-dir", str(run))
    assert done.returncode == TrainSettingsError.exit_code, done.stderr
    assert done.stderr.startswith(f"error: {run / 'summary.json'}: not a run's summary")
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1


def _train_process(
    tmp_path: Path, probe_env: tuple[str, dict[str, str]]
) -> tuple[subprocess.Popen[str], Path]:
    """``tooling train --preset smoke`` in the probe interpreter, its own cache and $TMPDIR."""
    python, env = probe_env
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    command = [sys.executable, "-m", "tooling", "--no-progress", "--cache-dir"]
    command += [str(tmp_path / "cache"), "train", "--preset", "smoke", "--python", python]
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        env={**env, "TMPDIR": str(scratch), "PYTHONPATH": env["PYTHONPATH"]},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, scratch


@pytest.mark.slow
def test_training_leaves_nothing_in_tmpdir(
    tmp_path: Path, probe_env: tuple[str, dict[str, str]]
) -> None:
    """torch's compile cache, torchinductor_<user>, stayed in $TMPDIR after every run."""
    proc, scratch = _train_process(tmp_path, probe_env)
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, err[-3000:]
    assert list(scratch.iterdir()) == []


@pytest.mark.slow
def test_a_stopped_training_says_so_once_and_leaves_nothing(
    tmp_path: Path, probe_env: tuple[str, dict[str, str]]
) -> None:
    """SIGTERM to `tooling train`: the recipe's child printed its own "interrupted" line
    before the command's, on the same stderr."""
    proc, scratch = _train_process(tmp_path, probe_env)
    trained = tmp_path / "cache" / "trained"
    wait_until(lambda: any(trained.glob(".*.tmp-*/train.log")), "the recipe's run", alive=proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 143, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: interrupted (SIGTERM)"
    ]
    assert list(scratch.iterdir()) == [] and list(trained.iterdir()) == []


_LOST_STOP = """
import sys
from pathlib import Path
from tooling.trainer.api import TrainRequest
from tooling.trainer.common import Log, StopRequest
from tooling.trainer.recipe import train
# A SIGTERM whose KeyboardInterrupt Python dropped (raised inside a finalizer): the
# handler recorded it, nothing else saw it.
StopRequest.signum = 15
try:
    train(TrainRequest(preset="smoke", out_dir=Path(sys.argv[1])), Log())
except KeyboardInterrupt as e:
    print("stopped", e.args[0])
"""


@pytest.mark.slow
def test_a_stop_the_run_did_not_see_still_keeps_its_pair_unpublished(
    tmp_path: Path, probe_env: tuple[str, dict[str, str]]
) -> None:
    """CI once found a published pair after a SIGTERM, the command exiting 143: the run had
    gone on to the end. A recorded stop is read before the pair is published."""
    python, env = probe_env
    run = tmp_path / "run"
    done = subprocess.run(
        [python, "-c", _LOST_STOP, str(run)],
        cwd=REPO_DIR,
        env={**env, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.stdout.strip() == "stopped 15", done.stderr[-3000:]
    assert not run.exists() and not list(tmp_path.glob(".run.tmp-*"))
