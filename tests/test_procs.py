"""``procs.output``: a child's failure is one line of the error the caller names (its exit
code from the error table); and how the log shows a command."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tooling import procs
from tooling.errors import EnvironmentProblem, ProbeError


def test_output_is_what_the_child_prints() -> None:
    out = procs.output(
        [sys.executable, "-c", "print('hello')"], what="ask", error=ProbeError, timeout_s=60
    )
    assert out == "hello\n"


def test_a_child_that_fails_is_its_last_stderr_line() -> None:
    code = "import sys; print('first', file=sys.stderr); sys.exit('the reason')"
    with pytest.raises(ProbeError) as e:
        procs.output([sys.executable, "-c", code], what="ask", error=ProbeError, timeout_s=60)
    assert str(e.value) == "ask: exit status 1: the reason"
    assert e.value.exit_code == 12


def test_a_program_that_cannot_start_names_why(tmp_path: Path) -> None:
    with pytest.raises(EnvironmentProblem) as e:
        procs.output(
            [str(tmp_path / "absent")], what="run it", error=EnvironmentProblem, timeout_s=60
        )
    assert str(e.value) == "run it: No such file or directory"


def test_a_child_past_its_time_is_stopped_and_named() -> None:
    code = "import time; time.sleep(600)"
    with pytest.raises(ProbeError) as e:
        procs.output([sys.executable, "-c", code], what="ask", error=ProbeError, timeout_s=1)
    assert str(e.value) == "ask: no answer within 1s"


def test_the_logged_command_hides_a_password_and_shortens_a_script() -> None:
    line = procs.shown(["pip", "--index-url", "https://me:secret@host/simple", "-c", "a\nb"])
    assert line == "pip --index-url https://***@host/simple -c 'a ...'"
