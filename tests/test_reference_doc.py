"""docs/reference/cli.md is what ``make reference-docs`` makes of the command line as it is:
the committed page equals a fresh render, and the render names every command, every option
and every error class with its exit code."""

from __future__ import annotations

import subprocess
from pathlib import Path

import click
import pytest

from tooling import errors
from tooling.cli import main
from tooling.cli.reference import PAGE, REGENERATE, commands, error_classes, escape, render

from .helpers import run_module

ROOT = Path(__file__).resolve().parent.parent


def test_the_committed_page_is_the_generated_one() -> None:
    committed = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
    assert committed == render(main), (
        f"{PAGE.relative_to(ROOT)} is not what the command line makes: run `{REGENERATE}` "
        "and commit the page"
    )


def sections(page: str) -> dict[str, str]:
    """The page's text under each ``## `tooling ...` `` heading, by command."""
    found = {}
    for chunk in page.split("\n## `")[1:]:
        heading, _, body = chunk.partition("\n")
        found[heading.rstrip("`")] = body
    return found


def test_every_command_and_its_options_are_on_the_page() -> None:
    """Walked here with Click's own API, not the renderer's walk: a command group
    added (``tooling host``) or an option added shows on the page or fails here."""
    by_command = sections(render(main))
    pending: list[tuple[str, click.Command]] = [("tooling", main)]
    seen = []
    while pending:
        path, command = pending.pop()
        seen.append(path)
        body = by_command[path]
        # A hidden option (``tooling host --script``, which only ci/gpu's callers pass)
        # is not the user's to type.
        for param in (p for p in command.params if not getattr(p, "hidden", False)):
            # An argument shows by the name its usage line gives it (``WORDS``).
            shown = [param.human_readable_name] if isinstance(param, click.Argument) else param.opts
            for opt in shown:
                assert f"`{opt}`" in body, f"{path}: {opt} is not on the page"
        if isinstance(command, click.Group):
            ctx = click.Context(command)
            for name in command.list_commands(ctx):
                pending.append((f"{path} {name}", command.get_command(ctx, name)))
    assert sorted(seen) == sorted(by_command)
    assert {"tooling fuzz scheduler", "tooling patch status", "tooling smoke"} <= set(seen)


def test_every_error_class_has_its_exit_code() -> None:
    page = render(main)
    classes = error_classes()
    assert errors.SmokePairError in classes and errors.WorkTreeError in classes
    for cls in classes:
        assert f"| {cls.exit_code} | `{cls.__name__}` |" in page
    # Every code a class owns, and Click's usage error, once each in code order.
    table = page.split("## Exit codes")[1]
    codes = [row.split(" | ")[0].strip("| ") for row in table.splitlines() if row[:2] == "| "]
    assert codes[:4] == ["code", "0", "1", "2"] and codes[-1] == "128 + N"
    numbers = [int(c) for c in codes[1:-1]]
    assert numbers == sorted(numbers)


def test_the_walk_is_in_name_order_and_deterministic() -> None:
    paths = [path for path, _ in commands(main, "tooling")]
    assert paths[0] == "tooling" and paths.index("tooling patch") < paths.index("tooling smoke")
    assert paths.index("tooling patch") + 1 == paths.index("tooling patch export")
    assert render(main) == render(main)


@pytest.mark.parametrize(
    ("text", "cell"),
    [
        ("build/work/vllm-<base>", "build/work/vllm-&lt;base&gt;"),
        ("the one vllm-*.whl in --dist", "the one vllm-\\*.whl in --dist"),
        ("a | b, `x|*<y>`", "a \\| b, `x\\|*<y>`"),
        ("a ``dflash_config`` key", "a `dflash_config` key"),
    ],
)
def test_help_text_is_escaped_for_a_table_cell(text: str, cell: str) -> None:
    assert escape(text) == cell


def run_generator(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_module("tooling.cli.reference", *args)


def test_the_command_writes_the_page_and_checks_it(tmp_path: Path) -> None:
    out = tmp_path / "cli.md"
    done = run_generator("-o", out)
    assert done.returncode == 0, done.stderr
    assert out.read_text(encoding="utf-8") == render(main)
    assert run_generator("-o", out, "--check").returncode == 0
    out.write_text(out.read_text(encoding="utf-8") + "edited by hand\n", encoding="utf-8")
    stale = run_generator("-o", out, "--check")
    assert stale.returncode == 1
    assert stale.stderr == f"error: {out} is not the generated page: run `{REGENERATE}`\n"
