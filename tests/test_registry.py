"""One registry: patches/series.toml alone says which fixes exist and which probe decides each.

Adding a patch touches the ledger and its probe module, nothing else: the probes run,
verify's fix table, ``--require`` and the help texts follow. A probe module the ledger
does not name, or a ledger entry naming no probe module, is a one-line error.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import SeriesError, VerifyFixMissingError
from tooling.patching import registry as registry_module
from tooling.patching.registry import LEDGER, load_registry, registry
from tooling.patching.series import load_series
from tooling.paths import PACKAGE_DIR
from tooling.probing import probe_modules

from .helpers import PATCHES

NEW_PROBE = """
from .result import PRESENT, ProbeResult

NAME = "new_fix"


def run() -> ProbeResult:
    return ProbeResult(probe=NAME, status=PRESENT, evidence="the new fix behaves as fixed")
"""

NEW_ENTRY = """
[[patch]]
id = "new-fix"
file = "{file}"
sha256 = "{sha}"
title = "One more fix"
why = "Proves that a patch needs its ledger entry and its probe, nothing else."
files = ["vllm/envs.py"]
touches_compiled_code = false
probe = "new_fix"
"""


def _ledger_copy(tmp_path: Path, edit) -> Path:
    ledger = tmp_path / "series.toml"
    ledger.write_text(edit((PATCHES / "series.toml").read_text()))
    return ledger


def _without_last_entry(text: str) -> str:
    return text[: text.rindex("[[patch]]")]


def test_the_shipped_ledger_is_patches_series_toml_itself():
    assert LEDGER.is_symlink() and LEDGER.resolve() == (PATCHES / "series.toml").resolve()
    series = load_series(PATCHES / "series.toml")
    fixes = registry().fixes
    assert [(f.number, f.patch_id, f.probe) for f in fixes] == [
        (p.index, p.id, p.probe) for p in series.patches
    ]
    assert [f.number for f in fixes] == list(range(1, len(series.patches) + 1))


def test_every_probe_module_is_named_by_exactly_one_fix_and_is_called_so():
    assert sorted(registry().probes) == list(probe_modules())
    for name in probe_modules():
        tree = ast.parse((PACKAGE_DIR / "probes" / f"{name}.py").read_text())
        declared = [
            node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["NAME"]
        ]
        assert declared == [name], f"probes/{name}.py declares NAME {declared}"


def test_an_entry_naming_no_probe_module_is_one_line(tmp_path, monkeypatch):
    ledger = _ledger_copy(tmp_path, lambda t: t.replace('probe = "fp8_kv"', 'probe = "fp8_kvv"'))
    with pytest.raises(SeriesError, match=r"patch #5: probe 'fp8_kvv' is no module of tooling/"):
        load_registry(ledger)
    monkeypatch.setattr(registry_module, "LEDGER", ledger)
    registry.cache_clear()
    try:
        result = CliRunner().invoke(main, ["verify", "--require", "1"])
    finally:
        registry.cache_clear()
    assert result.exit_code == SeriesError.exit_code == 10
    assert result.stderr == (
        f"error: {ledger}: patch #5: probe 'fp8_kvv' is no module of tooling/probes (have "
        f"{', '.join(probe_modules())})\n"
    )


def test_a_probe_module_no_entry_names_is_one_line(tmp_path, monkeypatch):
    ledger = _ledger_copy(tmp_path, _without_last_entry)
    last = registry().fixes[-1].probe
    message = f"probe module {last} is named by no patch in {ledger}"
    with pytest.raises(SeriesError, match=message):
        load_registry(ledger)
    monkeypatch.setattr(registry_module, "LEDGER", ledger)
    registry.cache_clear()
    try:
        probe = CliRunner().invoke(main, ["probe", "--probe", "layer_offset"])
        help_text = CliRunner().invoke(main, ["verify", "--help"])
    finally:
        registry.cache_clear()
    for result in (probe, help_text):
        assert result.exit_code == SeriesError.exit_code
        assert result.stderr.startswith(f"error: {message}:") and result.stderr.count("\n") == 1


def test_two_entries_naming_one_probe_are_refused(tmp_path):
    ledger = _ledger_copy(
        tmp_path, lambda t: t.replace('probe = "compile_key"', 'probe = "fp8_kv"')
    )
    with pytest.raises(
        SeriesError, match="dflash-fp8-kv-cache and dflash-compile-key both name probe 'fp8_kv'"
    ):
        load_registry(ledger)


def _fake_site(site: Path) -> None:
    """A site-packages whose vLLM imports but has none of vLLM's code: the real probes read
    unknown on it, a probe that needs no vLLM code answers."""
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text('__version__ = "0.0.1"\n')
    info = site / "vllm-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.0.1\n")
    rows = []
    for rel in ("vllm/__init__.py", "vllm-0.0.1.dist-info/METADATA"):
        data = (site / rel).read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{rel},sha256={digest},{len(data)}\n")
    (info / "RECORD").write_text("".join(rows) + "vllm-0.0.1.dist-info/RECORD,,\n")


def _tooling_copy(root: Path, *, links: bool) -> Path:
    """The package copied under ``root``: ``links`` keeps series.toml a link (a checkout),
    otherwise it becomes the file the link points at (as the wheel packs it)."""
    shutil.copytree(
        PACKAGE_DIR, root / "tooling", symlinks=links, ignore=shutil.ignore_patterns("__pycache__")
    )
    return root


def _run_copy(root: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("TOOLING_PATCHES_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "tooling", "--no-progress", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_adding_a_patch_touches_the_ledger_and_its_probe_nothing_else(tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copytree(PATCHES, checkout / "patches")
    _tooling_copy(checkout, links=True)
    # The two additions: a probe module, and the ledger's entry (with its patch file).
    (checkout / "tooling" / "probes" / "new_fix.py").write_text(NEW_PROBE)
    shipped = registry().fixes
    new_number = len(shipped) + 1
    patch_file = checkout / "patches" / f"{new_number:04d}-new-fix.patch"
    patch_file.write_text("--- a/vllm/envs.py\n+++ b/vllm/envs.py\n")
    sha = hashlib.sha256(patch_file.read_bytes()).hexdigest()
    with open(checkout / "patches" / "series.toml", "a") as ledger:
        ledger.write(NEW_ENTRY.format(file=patch_file.name, sha=sha))
    site = tmp_path / "site"
    _fake_site(site)

    help_text = _run_copy(checkout, "verify", "--help", cwd=tmp_path).stdout
    numbers = ", ".join(str(n) for n in range(1, new_number + 1))
    assert f"some of {numbers} (numbers" in " ".join(help_text.split())
    probe_help = " ".join(_run_copy(checkout, "probe", "--help", cwd=tmp_path).stdout.split())
    assert f"{shipped[-1].probe}, new_fix." in probe_help
    done = _run_copy(
        checkout,
        "verify",
        "--site-packages",
        str(site),
        "--probe-python",
        sys.executable,
        "--require",
        "new-fix",
        "--json",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [(f["number"], f["patch_id"], f["probe"]) for f in report["fixes"]] == [
        *[(f.number, f.patch_id, f.probe) for f in shipped],
        (new_number, "new-fix", "new_fix"),
    ]
    assert report["required"] == [new_number]
    assert report["fixes"][-1]["state"] == "present (upstream form)"
    assert report["fixes"][-1]["evidence"] == "the new fix behaves as fixed"
    # The shipped probes ran too, on a vLLM that has none of their code.
    assert {f["state"] for f in report["fixes"][:-1]} == {"unknown"}


def test_verify_needs_no_checkout(tmp_path):
    """An installed toolchain has tooling/series.toml as a file and no patches/ beside it."""
    installed = _tooling_copy(tmp_path / "site-packages", links=False)
    assert not (installed / "patches").exists()
    assert not (installed / "tooling" / "series.toml").is_symlink()
    site = tmp_path / "vllm-site"
    _fake_site(site)
    done = _run_copy(
        installed,
        "verify",
        "--site-packages",
        str(site),
        "--probe-python",
        sys.executable,
        "--json",
        cwd=tmp_path,
    )
    assert done.returncode == VerifyFixMissingError.exit_code, done.stderr
    report = json.loads(done.stdout)
    numbers = [f.number for f in registry().fixes]
    assert [f["number"] for f in report["fixes"]] == numbers
    assert report["required"] == numbers
