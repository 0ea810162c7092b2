"""One voice: the library logs through ``logging`` under each module's own name, prints
nothing (stdout is a command's result, or an internal entry's answer through one function),
and keeps a URL's password out of its log; an entry run as a program answers on stdout and
fails as the command line does."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from tooling.paths import PACKAGE_DIR, REPO_DIR
from tooling.pidfile import record
from tooling.procs import redacted, shown

#: The stages and the shared modules that do steps of their own: each logs under its name.
LOGGED = (
    "fetching",
    "patching",
    "building",
    "verifying",
    "release",
    "probing",
    "fuzzing",
    "smoke",
    "trained",
    "trainer",
    "host",
)
#: Pure modules (data, parsing, documents: no step to log), the program's entry, and where
#: the log lines go (entry.py: the handlers themselves).
PURE = {
    "__main__.py",
    "entry.py",
    "building/identity.py",
    "building/manifest.py",
    "building/sbom.py",
    "errors.py",
    "fetching/gitinput.py",
    "host/variants.py",
    "patching/hunks.py",
    "patching/outcome.py",
    "patching/registry.py",
    "paths.py",
    "progress.py",
    "release/files.py",
    "release/lock.py",
    "report.py",
    "schema.py",
    # The smoke's checks, verdicts, settings, plan arithmetic and readers of a pair, of
    # metrics and of an engine's log: observations in, figures or verdicts out.
    "smoke/checks/base.py",
    "smoke/checks/cache.py",
    "smoke/checks/engine.py",
    "smoke/checks/lossless.py",
    "smoke/config.py",
    "smoke/distribution.py",
    "smoke/distribution_plan.py",
    "smoke/logscan.py",
    "smoke/metrics.py",
    "smoke/pair.py",
    "smoke/pair_schema.py",
    "smoke/plan/deadlines.py",
    "smoke/plan/make.py",
    "smoke/plan/memory.py",
    "smoke/plan/model.py",
    "smoke/plan/reference.py",
    "smoke/serving/agreement.py",
    "smoke/serving/slotaudit.py",
    "smoke/verdicts.py",
    # The HTTP calls alone: a request each, many a second under load; the steps that make
    # them (a server observed, a burst sent) log under their own modules.
    "smoke/client.py",
    "trained/hybrid_verdicts.py",
    "trained/serving/trace_split.py",
    # The speed report's tables: a run's figures in, Markdown lines out.
    "trained/speed_tables.py",
    # The engines a speed run can serve, as data.
    "trained/speed_engines.py",
    # The recipe's settings, a config as data, its choice of prompts, torch helpers.
    "trainer/checked.py",
    "trainer/config.py",
    "trainer/hybrid.py",
    "trainer/torchutil.py",
}
#: Run in another interpreter, or shipped in the bundle: they answer through one function.
ANSWERING = {
    "release/bundle_files/join.py": {"_say", "_refuse"},
    "release/bundle_files/check_present.py": {"_refuse"},
    "verifying/inside/bytecode_check.py": {"_answer"},
    "host/kernels.py": {"_answer"},
}
#: Where the command line writes its results (click.echo) and the probes, copied into the
#: probed interpreter, write theirs (files).
OUTSIDE = ("cli/", "probes/")


def _library() -> dict[str, ast.Module]:
    return {
        path.relative_to(PACKAGE_DIR).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if path.name != "__init__.py"
    }


LIBRARY = _library()


def _own_logger(tree: ast.Module) -> bool:
    """``logger = logging.getLogger(__name__)`` at the module's top level."""
    return any(
        isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["logger"]
        and ast.unparse(node.value) == "logging.getLogger(__name__)"
        for node in tree.body
    )


def _prints(tree: ast.Module) -> list[tuple[int, str]]:
    """Each ``print(...)`` call: its line and the function it stands in (``""`` at the top)."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name)
                continue
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Name)
                and child.func.id == "print"
            ):
                found.append((child.lineno, function))
            visit(child, function)

    visit(tree, "")
    return found


def test_every_stage_and_shared_module_logs_under_its_own_name():
    assert {"fetching/fetch.py", "gitutil.py", "procs.py", "pidfile.py"} <= LIBRARY.keys()
    unlogged = sorted(
        name
        for name, tree in LIBRARY.items()
        if not name.startswith((*OUTSIDE, *ANSWERING))
        and name not in PURE
        and not _own_logger(tree)
        and (name.startswith(LOGGED) or "/" not in name)
    )
    assert not unlogged, f"no logger = logging.getLogger(__name__) in {unlogged}"


def test_nothing_prints_but_an_answer_function():
    printing = {
        f"{name}:{line}"
        for name, tree in LIBRARY.items()
        if not name.startswith(OUTSIDE)
        for line, function in _prints(tree)
        if function not in ANSWERING.get(name, set())
    }
    assert not printing, sorted(printing)


def test_a_print_is_found_where_it_stands():
    source = (
        "print(1)\ndef _answer(x):\n    print(x)\nclass A:\n    def f(self):\n        print()\n"
    )
    assert _prints(ast.parse(source)) == [(1, ""), (3, "_answer"), (6, "f")]


def test_a_password_in_a_url_stays_out_of_the_log():
    assert redacted("fetch https://me:secret@mirror.example/simple/") == (
        "fetch https://***@mirror.example/simple/"
    )
    assert shown(["git", "fetch", "--", "https://tok@host/r.git"]) == (
        "git fetch -- https://***@host/r.git"
    )


def _entry(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_DIR)}
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_an_entry_answers_on_stdout_alone(tmp_path):
    """``python -m tooling.pidfile check``: the pid on stdout while the process runs; its
    refusal one ``error:`` line on stderr, as the command line's, and nothing on stdout."""
    recorded = tmp_path / "session.pid"
    record(recorded, os.getpid())
    running = _entry("tooling.pidfile", "check", str(recorded))
    assert (running.returncode, running.stdout, running.stderr) == (0, f"{os.getpid()}\n", "")
    broken = tmp_path / "broken.pid"
    broken.write_text("not a record\n")
    refused = _entry("tooling.pidfile", "check", str(broken))
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr.startswith(f"error: {broken}: not a record of a process")
    assert refused.stderr.count("\n") == 1


def test_an_entrys_own_info_line_reaches_its_stderr():
    """Run as a program, an entry's module is ``__main__``, outside the package's logger: its
    own INFO lines (the reference child's progress, which its log shows) reach stderr as a
    stage's do, bare; its DEBUG lines do not."""
    script = (
        "import logging\n"
        "from tooling.entry import entry_logging\n"
        "with entry_logging():\n"
        "    logging.getLogger(__name__).info('1/2 prompts compared')\n"
        "    logging.getLogger(__name__).debug('a step')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_DIR)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "1/2 prompts compared\n")
