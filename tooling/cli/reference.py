"""docs/reference/cli.md from the command line itself: every command of ``tooling`` with its
options (read from the Click objects), and every error class with its exit code (read from
``tooling.errors``), so the page is generated, never kept by hand, and cannot drift.

    python -m tooling.cli.reference -o docs/reference/cli.md   (``make reference-docs``)
    python -m tooling.cli.reference --check docs/reference/cli.md

The output depends on the code alone (no machine, no environment), so a test can regenerate
it and compare.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import click

from .. import errors
from ..entry import entry_logging
from ..paths import REPO_DIR
from ..report import markdown_table, write_page

logger = logging.getLogger(__name__)

TITLE = "# The command line: every command, option and exit code"
PAGE = REPO_DIR / "docs" / "reference" / "cli.md"
REGENERATE = "make reference-docs"

#: The codes no error class owns: Click's usage error and the signals (``group.ToolingGroup``).
OTHER_CODES = (
    (0, "0", "success", "The command did what it was asked."),
    (2, "2", "usage error", "Click refused the command line: an unknown option, a bad value."),
    (
        128,
        "128 + N",
        "signal N",
        "Ended by a signal: 130 Ctrl-C (SIGINT), 143 SIGTERM, 129 SIGHUP; temp files removed.",
    ),
)


def subcommands(group: click.Group) -> list[tuple[str, click.Command]]:
    """``group``'s commands in name order, through Click's API: the top group imports a
    command's module only when asked for it."""
    ctx = click.Context(group)
    found = ((name, group.get_command(ctx, name)) for name in sorted(group.list_commands(ctx)))
    return [(name, command) for name, command in found if command is not None]


def commands(group: click.Group, path: str) -> Iterator[tuple[str, click.Command]]:
    """``group`` and every command under it, depth first, subcommands in name order."""
    yield path, group
    for name, command in subcommands(group):
        if command.hidden:
            continue
        if isinstance(command, click.Group):
            yield from commands(command, f"{path} {name}")
        else:
            yield f"{path} {name}", command


def escape(text: str) -> str:
    """``text`` safe in a Markdown table cell: code spans kept, and outside them the
    characters Markdown would read as HTML, emphasis or a cell border escaped."""
    # The docstrings' reST ``code`` is Markdown's `code`.
    parts = re.split(r"(`[^`]*`)", text.replace("``", "`"))
    for i in range(0, len(parts), 2):
        part = parts[i].replace("\\", "\\\\").replace("*", "\\*")
        parts[i] = part.replace("<", "&lt;").replace(">", "&gt;")
    return "".join(parts).replace("|", "\\|")


def help_paragraphs(command: click.Command) -> list[str]:
    """The command's help as Click shows it (cut at ``\\f``, ``\\b`` markers dropped), one
    string a paragraph, its lines joined."""
    text = inspect.cleandoc(command.help or "").partition("\f")[0]
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.splitlines() if line.strip() != "\b"]
        if lines:
            paragraphs.append(escape(" ".join(lines)))
    return paragraphs


def type_cell(param: click.Parameter) -> str:
    """What the option takes: flag, one of its choices, a range, a file or folder, text."""
    if isinstance(param, click.Option) and param.is_flag:
        return "flag"
    # A plain dict: each type's info has its own keys (choices, min and max).
    info: dict[str, Any] = dict(param.type.to_info_dict())
    kind = info["param_type"]
    if kind == "Choice":
        cell = "one of " + ", ".join(f"`{c}`" for c in info["choices"])
    elif "min" in info:
        bounds = [
            (strict if info[f"{end}_open"] else sign) + str(info[end])
            for end, sign, strict in (("min", "≥ ", "> "), ("max", "≤ ", "< "))
            if info[end] is not None
        ]
        cell = f"{info['name'].split()[0]} {', '.join(bounds)}".strip()
    elif kind == "Path":
        cell = {"file": "file", "directory": "folder"}.get(info["name"], "path")
    else:
        cell = info["name"]
    if param.metavar:
        cell += f" (`{param.metavar}`)"
    return cell + (", repeatable" if param.multiple else "")


def default_cell(param: click.Parameter) -> str:
    default: Any = param.to_info_dict()["default"]
    if isinstance(param, click.Option) and param.is_flag and default is False:
        return ""
    if default is None or default == ():
        return ""
    return f"`{default}`"


def help_cell(param: click.Parameter) -> str:
    text = escape(" ".join((getattr(param, "help", None) or "").split()))
    notes = []
    if param.required:
        notes.append("required")
    if isinstance(param.envvar, str):
        notes.append(f"env `{param.envvar}`")
    return " ".join([text, *(f"({n})" for n in notes)]).strip()


def flags(param: click.Parameter) -> str:
    if isinstance(param, click.Argument):
        return f"`{param.human_readable_name}` (argument)"
    return ", ".join(f"`{opt}`" for opt in [*param.opts, *param.secondary_opts])


def command_section(path: str, command: click.Command) -> list[str]:
    """One command's heading, usage, help, options and exit codes."""
    usage = [path, "[OPTIONS]"]
    usage += [
        p.human_readable_name.upper() for p in command.params if isinstance(p, click.Argument)
    ]
    if isinstance(command, click.Group):
        # `tooling patch` runs alone too (it applies the series); its subcommands are optional.
        usage.append("[COMMAND]" if command.invoke_without_command else "COMMAND")
    lines = [f"## `{path}`", "", f"`{' '.join(usage)}`", ""]
    for paragraph in help_paragraphs(command):
        lines += [paragraph, ""]
    if isinstance(command, click.Group):
        names = [n for n, c in subcommands(command) if not c.hidden]
        links = [f"[`{n}`](#{anchor(f'{path} {n}')})" for n in names]
        lines += ["Commands: " + ", ".join(links) + ".", ""]
    rows = [
        [flags(p), type_cell(p), default_cell(p), help_cell(p)]
        for p in command.params
        if not getattr(p, "hidden", False)
    ]
    if rows:
        lines += [*markdown_table(["option", "takes", "default", "what it does"], rows), ""]
    lines += [
        "Exit codes: 0 on success; a failure exits with its own code ([the table](#exit-codes)).",
        "",
    ]
    return lines


def anchor(path: str) -> str:
    """The anchor GitHub gives a command's heading (``## `tooling patch status` ``)."""
    return path.replace(" ", "-")


def error_classes() -> list[type[errors.ToolingError]]:
    """Every error class of ``tooling.errors``, by exit code then name."""
    found: list[type[errors.ToolingError]] = []
    pending: list[type[errors.ToolingError]] = [errors.ToolingError]
    while pending:
        cls = pending.pop()
        if cls.__module__ == errors.__name__:
            found.append(cls)
        pending += cls.__subclasses__()
    return sorted(found, key=lambda c: (c.exit_code, c.__name__))


def exit_code_rows() -> list[list[str]]:
    """The exit-code table's rows, by code: the codes no class owns among one a class."""
    rows = [(n, [code, what, "", meaning]) for n, code, what, meaning in OTHER_CODES]
    for cls in error_classes():
        meaning = " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split())
        is_a = "" if cls is errors.ToolingError else f"`{cls.__mro__[1].__name__}`"
        if cls is errors.ToolingError:
            meaning += " Also an unexpected error (a bug): one line, the traceback with --debug."
        rows.append(
            (cls.exit_code, [str(cls.exit_code), f"`{cls.__name__}`", is_a, escape(meaning)])
        )
    # sorted() is stable: within a code, classes stay in error_classes()'s name order.
    return [row for _, row in sorted(rows, key=lambda r: r[0])]


def render(main: click.Group, name: str = "tooling") -> str:
    """The page for the command line ``main``, run as ``name`` (pure: the same code gives the
    same page)."""
    sections = list(commands(main, name))
    lines = [
        TITLE,
        "",
        f"Generated by `{REGENERATE}` from the Click commands and `tooling/errors.py`; do not",
        "edit by hand. Every command takes `--json` (one JSON document on stdout, a failure's",
        "too) and the group's options go before the command: `tooling --offline fetch`.",
        "",
        *(f"- [`{path}`](#{anchor(path)})" for path, _ in sections),
        "- [Exit codes](#exit-codes)",
        "",
    ]
    for path, command in sections:
        lines += command_section(path, command)
    lines += [
        "## Exit codes",
        "",
        "A failure prints one line on stderr (or its JSON document under `--json`) and exits",
        "with its class's code; a subclass without a code of its own has its parent's.",
        "",
        *markdown_table(["code", "error", "is a", "what it means"], exit_code_rows()),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from . import main as tooling_main

    parser = argparse.ArgumentParser(
        prog="python -m tooling.cli.reference",
        description="Write docs/reference/cli.md from the Click commands and the error table.",
    )
    parser.add_argument("-o", "--output", type=Path, default=PAGE, help="the page to write")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; fail when the page differs"
    )
    args = parser.parse_args(argv)
    page = render(tooling_main)
    with entry_logging():
        if args.check:
            current = args.output.read_text(encoding="utf-8") if args.output.exists() else None
            if current != page:
                logger.error(
                    "error: %s is not the generated page: run `%s`", args.output, REGENERATE
                )
                return 1
            return 0
        return write_page(parser, args.output, page)


if __name__ == "__main__":
    sys.exit(main())
