"""Every option a command accepts is honoured: the ``patch`` group's own options are refused
by the subcommands that do not use them, the git source's options without ``--source git``,
and ``bundle --dist`` is where the wheel is read. A usage error under ``--json`` is one
JSON document too."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from tooling.cli import main


def run(*args: str):
    return CliRunner().invoke(main, ["--no-progress", *args])


@pytest.mark.parametrize("subcommand", ["status", "export"])
@pytest.mark.parametrize(
    ("given", "flag"),
    [
        (("--skip", "eagle-cache-drop"), "--skip"),
        (("--keep-going",), "--keep-going"),
    ],
)
def test_patch_subcommands_refuse_group_options_they_do_not_honour(subcommand, given, flag):
    result = run("patch", *given, subcommand, "--check" if subcommand == "export" else "--json")
    assert result.exit_code == 2, result.output
    assert f"{flag} is an option of `tooling patch` itself" in result.output
    assert f"`tooling patch {subcommand}` does not honour it" in result.output


@pytest.mark.parametrize(
    ("given", "flag"),
    [(("--git-url", "https://example.invalid/vllm.git"), "--git-url"), (("--ref", "v0"), "--ref")],
)
def test_patch_status_refuses_the_git_source_options(given, flag):
    result = run("patch", "--source", "git", *given, "status")
    assert result.exit_code == 2, result.output
    assert f"{flag} is an option of `tooling patch` itself" in result.output


@pytest.mark.parametrize("command", ["fetch", "build", "patch"])
@pytest.mark.parametrize(
    ("given", "flag"),
    [
        (("--ref", "v0.22.0"), "--ref"),
        (("--git-url", "https://example.invalid/vllm.git"), "--git-url"),
        (("--allow-moving-ref",), "--allow-moving-ref"),
    ],
)
@pytest.mark.parametrize("source", [(), ("--source", "pypi")])
def test_git_source_options_without_source_git_are_refused(tmp_path, command, given, flag, source):
    """`build --ref v0.22.0` built 0.20.1 from PyPI: the ref was never read. Refused before any
    work (an empty cache, offline: anything fetched would be another error)."""
    cache = tmp_path / "cache"
    work = () if command == "fetch" else ("--work-dir", str(tmp_path / "w"))
    result = run("--offline", "--cache-dir", str(cache), command, *source, *given, *work)
    assert result.exit_code == 2, result.output
    assert result.stderr.endswith(
        f"\n\nError: {flag} needs --source git; --source pypi would ignore it\n"
    ), result.stderr
    assert not cache.exists() and not (tmp_path / "w").exists()


def test_patch_export_honours_the_group_work_dir(tmp_path):
    work = tmp_path / "no-such-tree"
    result = run("patch", "--work-dir", str(work), "export")
    assert result.exit_code == 10, result.output
    assert f"{work}: no work tree to export" in result.output


def test_bundle_reads_the_wheel_from_dist(tmp_path):
    dist = tmp_path / "elsewhere"
    dist.mkdir()
    (dist / "vllm-0.20.1-py3-none-any.whl").write_bytes(b"")
    (dist / "vllm-0.20.2-py3-none-any.whl").write_bytes(b"")
    result = run("bundle", "--dist", str(dist), "--lock-only", str(tmp_path / "lock.txt"))
    assert result.exit_code == 13, result.output
    assert f"{dist}: expected one vllm-*.whl, found 2" in result.output
    assert not (tmp_path / "lock.txt").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--num-speculative-tokens", "0"), "'--num-speculative-tokens': 0 is not in the range"),
        (("--tensor-parallel-size", "0"), "'--tensor-parallel-size': 0 is not in the range x>=1"),
        (("--gpu-memory-utilization", "0"), "0.0 is not in the range 0.0<x<=1.0"),
        (("--gpu-memory-utilization", "1.5"), "1.5 is not in the range 0.0<x<=1.0"),
        (("--kv-cache-memory-bytes", "-1"), "'--kv-cache-memory-bytes': -1 is not in the range"),
        (("--time-limit", "0"), "'--time-limit': 0.0 is not in the range 0.0<x<=604800"),
        (("--tiny-hidden-size", "0"), "'--tiny-hidden-size': 0 is not in the range x>=1"),
        (("--min-acceptance-length", "1"), "1.0 is not in the range x>1.0"),
        (("--fidelity-gate", "0"), "'--fidelity-gate': 0.0 is not in the range 0.0<x<=1.0"),
        (("--speculative-option", "model=x"), "model: the smoke sets it itself (give --drafter)"),
        (("--speculative-option", "dflash_full_cudagraphs"), "not KEY=VALUE"),
        (("--speculative-option", "a b=1"), "not KEY=VALUE"),
    ],
)
def test_a_smoke_figure_out_of_range_is_a_usage_error_before_any_plan(tmp_path, args, message):
    """A zero or negative K or tensor-parallel size used to print a plan with exit 0 (or fail
    dividing by zero): no engine could serve it."""
    workdir = tmp_path / "w"
    result = run(
        "smoke", "--tiny", "--dry-run", "--gpus", "1x141", "--workdir", str(workdir), *args,
        "--json",
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert message in json.loads(result.stdout)["error"]
    assert not workdir.exists()


@pytest.mark.parametrize(
    "args",
    [
        ("fetch", "--base", ""),
        ("fetch", "--source", "git", "--git-url", ""),
        ("fetch", "--source", "git", "--ref", " "),
        ("build", "--base", ""),
        ("bundle", "--base", ""),
        ("patch", "status", "--bases", ""),
    ],
)
def test_an_empty_value_is_a_usage_error_not_the_default(tmp_path, args):
    """`fetch --base ''` fetched the default base and `patch status --bases ''` passed a
    canary over no release, both with exit 0."""
    result = run("--offline", "--cache-dir", str(tmp_path / "cache"), *args, "--json")
    assert result.exit_code == 2, result.output
    flag = next(a for a in args if a.startswith("--") and a != "--source")
    assert f"'{flag}': it is empty" in json.loads(result.stdout)["error"]
    assert not (tmp_path / "cache").exists()


def test_a_release_list_that_names_none_is_refused():
    result = run("patch", "status", "--bases", " , ", "--json")
    assert result.exit_code == 4, result.output
    assert json.loads(result.stdout)["error"] == "releases ' , ' name none: give versions, or all"


@pytest.mark.parametrize(
    "args",
    [("patch", "status", "--workers", "0"), ("build", "--max-jobs", "0")],
)
def test_a_worker_count_below_one_is_a_usage_error(args):
    result = run(*args, "--json")
    assert result.exit_code == 2, result.output
    assert "0 is not in the range x>=1" in json.loads(result.stdout)["error"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("fetch", "--bogus", "--json"), "No such option '--bogus'"),
        (("fetch", "--json", "--bogus"), "No such option '--bogus'"),
        (
            ("fetch", "--source", "svn", "--json"),
            "Invalid value for '--source': 'svn' is not one of 'pypi', 'git'.",
        ),
        (("--bogus", "fetch", "--json"), "No such option '--bogus'"),
        (("patch", "--bogus", "status", "--json"), "No such option '--bogus'"),
        (("patch", "status", "--workers", "many", "--json"), "'many' is not a valid integer"),
        (("bogus", "--json"), "No such command 'bogus'."),
        (
            ("build", "--ref", "v0.22.0", "--json"),
            "--ref needs --source git; --source pypi would ignore it",
        ),
    ],
)
def test_a_usage_error_under_json_is_one_json_document(args, message):
    """Under --json stdout is one JSON document, a usage error's too (exit 2 kept); stderr
    has the error's one line."""
    result = run(*args)
    assert result.exit_code == 2, result.output
    error = json.loads(result.stdout)
    assert (error["ok"], error["exit_code"]) == (False, 2), error
    assert message in error["error"], error
    assert result.stderr == f"error: {error['error']}\n"


def test_probes_that_reach_no_verdict_are_exit_12_after_their_table(tmp_path):
    """A folder with no vllm/ in it: every probe answers unknown, which used to print the
    table with exit 0 (ok: true)."""
    empty = tmp_path / "tree"
    empty.mkdir()
    args = ("probe", "--root", str(empty), "--python", sys.executable, "--probe", "layer_offset")
    result = run("--cache-dir", str(tmp_path / "cache"), *args, "--json")
    assert result.exit_code == 12, result.output
    document = json.loads(result.stdout)
    assert document["ok"] is False
    assert [r["status"] for r in document["results"]] == ["unknown"]
    assert result.stderr.startswith("error: 1 of 1 probes reached no verdict; layer_offset: ")
    assert result.stderr.count("\n") == 1


def test_a_speculative_option_reaches_every_dflash_engine_of_the_plan(tmp_path):
    """``--speculative-option KEY=VALUE`` adds KEY to the DFlash engines' speculative config
    with VALUE's JSON type (text where it is not JSON); the plan names what it adds."""
    args = (
        "smoke", "--tiny", "--dry-run", "--gpus", "1x141", "--workdir", str(tmp_path / "w"),
        "--speculative-option", "dflash_full_cudagraphs=true",
        "--speculative-option", "join_hold_steps=4", "--speculative-option", "name=abc",
    )  # fmt: skip
    result = run(*args)
    assert result.exit_code == 0, result.output
    assert (
        "every DFlash engine's --speculative-config adds: dflash_full_cudagraphs=true, "
        'join_hold_steps=4, name="abc"'
    ) in result.stdout
    plan = json.loads(run(*args, "--json").stdout)
    assert plan["plan"]["engine"]["speculative_options"] == [
        ["dflash_full_cudagraphs", True],
        ["join_hold_steps", 4],
        ["name", "abc"],
    ]
