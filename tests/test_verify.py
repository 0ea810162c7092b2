"""verify on real installs of our wheel: the install, site-packages and --python modes, bytecode,
tampered and stray files (stock installs: tests/test_verify_stock.py)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import git
import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import (
    ConfigError,
    VerifyFixMissingError,
    VerifyIntegrityError,
    VllmNotFoundError,
)
from tooling.patching import worktree
from tooling.patching.registry import registry
from tooling.probing import ProbeTarget
from tooling.verifying.verify import (
    VersionIdentity,
    install_into_fresh_env,
    locate_in_site,
    locate_with_python,
    verify,
)

from .verify_helpers import ALL, run_cli, states


@pytest.fixture(scope="module")
def patched_env(tmp_path_factory, built_wheel, probe_python) -> Path:
    return install_into_fresh_env(
        built_wheel.path, probe_python, tmp_path_factory.mktemp("patched") / "venv"
    )


def site_of(python: Path) -> Path:
    return locate_with_python(python).site


#: For tests about files only: the toolchain's interpreter has no torch, so the probes
#: it runs read "unknown" within a second instead of importing vLLM for 15.
NO_TORCH = sys.executable


@pytest.mark.slow
def test_patched_wheel_installs_and_verifies(
    patched_env, built_wheel, patched_0201, upstream_0201, series, cache
):
    shown = subprocess.run(
        [str(patched_env), "-m", "pip", "show", "vllm"], capture_output=True, text=True, check=True
    ).stdout
    assert f"Version: {built_wheel.version}" in shown.splitlines()
    dist = locate_with_python(patched_env)
    assert dist.version == built_wheel.version
    repo = git.Repo(patched_0201.work_dir)
    for rel in ("vllm/v1/worker/gpu_model_runner.py", "vllm/config/speculative.py"):
        assert (dist.site / rel).read_bytes() == worktree.read_blob(repo, "HEAD", rel)
    # Every file the series did not touch keeps the official wheel's RECORD line.
    with zipfile.ZipFile(upstream_0201.wheel) as off:
        official = {
            r[0]: r[1:]
            for r in csv.reader(io.StringIO(off.read("vllm-0.20.1.dist-info/RECORD").decode()))
            if r
        }
    installed = {
        r[0]: r[1:]
        for r in csv.reader(io.StringIO((dist.site / dist.dist_info / "RECORD").read_text()))
        if r
    }
    same = [p for p in official if p.startswith("vllm/") and installed.get(p) == official[p]]
    replaced = {f.path for f in built_wheel.manifest.files}
    assert len(same) == len([p for p in official if p.startswith("vllm/")]) - len(
        replaced & set(official)
    )
    # A module the series adds is installed with its own RECORD line.
    assert all(p in installed for p in replaced - set(official))
    target = ProbeTarget(python=patched_env, pycache=cache.root / "pycache")
    report = verify(dist, target, ALL, bytecode_cache=cache.bytecode)
    assert report.integrity_ok, report.problems
    assert report.files_checked > 3000
    assert states(report) == ["present"] * len(ALL)
    assert report.manifest is not None and not report.missing_fixes
    # vLLM itself reports the build's version, so its compile caches can tell it from stock.
    assert report.identity.runtime == report.identity.stamped == built_wheel.version
    assert report.identity.problem is None


@contextmanager
def bare(python: Path) -> Iterator[Path]:
    """The install as a bare ``--no-deps`` one, as ``pip install --target`` leaves it on an
    offline host: without the line that lends its interpreter the probe environment's
    packages, so that interpreter cannot import torch. Yields its site-packages.

    The two tests that probe it through the probe environment's interpreter make one run
    between them (the second is answered from the probe cache, by the same bytes)."""
    site = site_of(python)
    deps = site / "dflash-probe-deps.pth"
    aside = deps.with_suffix(".aside")
    deps.rename(aside)
    try:
        yield site
    finally:
        aside.rename(deps)


@pytest.mark.slow
def test_site_packages_mode_and_json(patched_env, probe_python):
    with bare(patched_env) as site:
        result = run_cli(
            "verify", "--site-packages", str(site), "--probe-python", str(probe_python), "--json"
        )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] and data["built_by_us"] and data["integrity"]["problems"] == []
    assert [f["state"] for f in data["fixes"]] == ["present"] * len(ALL)
    assert data["identity"]["runtime"] == data["identity"]["stamped"] == data["vllm_version"]


@pytest.mark.slow
def test_probe_python_questions_a_no_deps_install_named_by_python(patched_env, probe_python):
    # Its own interpreter cannot import torch, so no probe can tell.
    with bare(patched_env):
        alone = run_cli("verify", "--python", str(patched_env), "--json")
        helped = run_cli(
            "verify", "--python", str(patched_env), "--probe-python", str(probe_python), "--json"
        )
    assert alone.returncode == VerifyFixMissingError.exit_code
    assert {f["state"] for f in json.loads(alone.stdout)["fixes"]} == {"unknown"}
    assert helped.returncode == 0, helped.stderr
    data = json.loads(helped.stdout)
    assert [f["state"] for f in data["fixes"]] == ["present"] * len(ALL)
    assert data["identity"]["runtime"] == data["identity"]["stamped"] == data["vllm_version"]


@pytest.mark.slow
def test_bytecode_python_would_run_instead_of_its_source_is_found(patched_env):
    import importlib._bootstrap_external as bootstrap
    import importlib.util

    quick = ("--python", str(patched_env), "--probe-python", NO_TORCH)
    clean = json.loads(run_cli("verify", *quick, "--json").stdout)
    # pip compiled the install: every module's bytecode, each matching its source.
    assert clean["integrity"]["bytecode"]["checked"] > 1000
    assert clean["integrity"]["bytecode"]["differ"] == []
    # Other code under a header that matches the untouched source: Python runs it.
    source = site_of(patched_env) / "vllm" / "logger.py"
    pyc = Path(importlib.util.cache_from_source(str(source)))
    original = pyc.read_bytes()
    stat = source.stat()
    evil = compile("raise SystemExit('not vLLM')", str(source), "exec")
    pyc.write_bytes(bootstrap._code_to_timestamp_pyc(evil, stat.st_mtime, stat.st_size))
    try:
        result = run_cli("verify", *quick)
    finally:
        pyc.write_bytes(original)
    assert result.returncode == VerifyIntegrityError.exit_code
    assert (
        f"bytecode: vllm/__pycache__/{pyc.name} (Python would run it for vllm/logger.py, "
        "but it was compiled from other code (timestamp header))"
    ) in result.stdout
    assert "bytecode: 1 of " in result.stdout
    # Pairs found equal are kept by their bytes (the install's own, restored, among them),
    # and are not compiled again; the other code never is kept.
    again = json.loads(run_cli("verify", *quick, "--json").stdout)["integrity"]["bytecode"]
    assert again["known"] == again["checked"] == clean["integrity"]["bytecode"]["checked"]
    assert again["differ"] == []


#: Run by the install's interpreter: write, where it would look for ``argv[1]``'s bytecode,
#: ``argv[2]`` compiled under ``argv[1]``'s timestamp header; print where.
_PLANT_PYC = """
import importlib._bootstrap_external as bootstrap, importlib.util, os, sys
source, other = sys.argv[1:]
st = os.stat(source)
with open(other, "rb") as f:
    code = compile(f.read(), source, "exec")
pyc = importlib.util.cache_from_source(source)
os.makedirs(os.path.dirname(pyc), exist_ok=True)
with open(pyc, "wb") as f:
    f.write(bootstrap._code_to_timestamp_pyc(code, st.st_mtime, st.st_size))
print(pyc)
"""


@pytest.mark.slow
def test_bytecode_a_pth_moves_elsewhere_is_checked_and_keys_the_probes(
    patched_env, upstream_0201, tmp_path
):
    """A ``.pth`` of the environment points ``sys.pycache_prefix`` elsewhere, and stock code
    under the patched source's header waits there: that is what the interpreter runs."""
    site = site_of(patched_env)
    prefix = tmp_path / "pfx"
    pth = site / "zz-pycache-prefix.pth"
    pth.write_text(f"import sys; sys.pycache_prefix = {str(prefix)!r}\n")
    rel = "vllm/v1/worker/gpu_model_runner.py"
    try:
        # The first run's probes write the bytecode under the prefix; the second, on bytes
        # that held still, keeps its verdicts.
        for _ in range(2):
            warm = run_cli("verify", "--python", str(patched_env), "--json")
            assert warm.returncode == 0, warm.stderr
        assert json.loads(warm.stdout)["integrity"]["bytecode"]["prefix"] == str(prefix)
        pyc = subprocess.run(
            [
                str(patched_env),
                "-c",
                _PLANT_PYC,
                str(site / rel),
                str(upstream_0201.source_dir / rel),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert pyc.startswith(str(prefix))
        result = run_cli("verify", "--python", str(patched_env), "--json")
    finally:
        pth.unlink()
    assert result.returncode == VerifyIntegrityError.exit_code, result.stderr
    data = json.loads(result.stdout)
    assert [(p["kind"], p["path"]) for p in data["integrity"]["problems"]] == [("bytecode", pyc)]
    assert f"Python would run it for {rel}" in data["integrity"]["problems"][0]["detail"]
    # The probes ran again, on what the interpreter really loads: stock's layer offset.
    assert not data["probes_cached"]
    offset = next(f for f in data["fixes"] if f["probe"] == "layer_offset")
    assert offset["state"] == "absent", offset["evidence"]


@pytest.mark.slow
def test_tampered_file_is_named_with_its_patch(patched_env):
    target = site_of(patched_env) / "vllm" / "model_executor" / "models" / "qwen3_dflash.py"
    original = target.read_bytes()
    # Same size, other bytes: only the digest can tell.
    target.write_bytes(
        original.replace(
            b'_DFLASH_WINDOW_BACKENDS = ("FLASH_ATTN",)',
            b'_DFLASH_WINDOW_BACKENDS = ("FLEX_ATTN_",)',
            1,
        )
    )
    try:
        result = run_cli("verify", "--python", str(patched_env), "--probe-python", NO_TORCH)
    finally:
        target.write_bytes(original)
    assert result.returncode == VerifyIntegrityError.exit_code
    assert (
        "modified: vllm/model_executor/models/qwen3_dflash.py (sha256 differs from RECORD) "
        "[patch 0002-dflash-swa-config.patch, 0005-dflash-fp8-kv-cache.patch, "
        "0037-context-kv-one-launch.patch]"
    ) in result.stdout
    assert result.stderr.strip().startswith("error: 1 file(s) differ from RECORD")


@pytest.mark.slow
def test_stray_file_is_reported(patched_env, cache):
    stray = site_of(patched_env) / "vllm" / "sitecustomize_evil.py"
    stray.write_text("print('hi')\n")
    try:
        dist = locate_with_python(patched_env)
        quick = ProbeTarget(python=Path(NO_TORCH), root=dist.site, pycache=cache.root / "pycache")
        report = verify(dist, quick, [], runtime_python=patched_env, bytecode_cache=cache.bytecode)
    finally:
        stray.unlink()
    assert [(p.kind, p.path) for p in report.problems] == [
        ("unexpected", "vllm/sitecustomize_evil.py")
    ]


def test_no_vllm_is_its_own_exit_code(tmp_path):
    import venv

    venv.EnvBuilder(with_pip=False).create(tmp_path / "empty")
    result = run_cli("verify", "--python", str(tmp_path / "empty" / "bin" / "python"))
    assert result.returncode == VllmNotFoundError.exit_code
    assert result.stderr.strip() == (
        f"error: no vLLM distribution installed for {tmp_path / 'empty' / 'bin' / 'python'}"
    )
    with pytest.raises(VllmNotFoundError, match="no vllm-\\*.dist-info"):
        locate_in_site(tmp_path)


def test_parse_require():
    assert registry().select("all") == ALL == list(range(1, len(registry().fixes) + 1))
    assert registry().select("3,dflash-layer-id-offset,swa_windows") == [1, 2, 3]
    with pytest.raises(ConfigError, match="--require 'nine'"):
        registry().select("nine")
    result = CliRunner().invoke(main, ["verify", "--require", "x"])
    assert result.exit_code == ConfigError.exit_code


@pytest.mark.parametrize("json_flag", [(), ("--json",)])
@pytest.mark.parametrize("spec", ["", ",", " "])
def test_a_require_list_naming_no_fix_is_a_usage_error(spec, json_flag):
    """An empty list would require nothing, and verify would pass a stock vLLM: refused
    before anything is verified."""
    result = CliRunner().invoke(main, ["verify", "--require", spec, *json_flag])
    assert result.exit_code == 2, result.output
    message = (
        f"Invalid value for '--require': {spec!r} names no fix "
        f"(all, or some of {registry().numbers})"
    )
    if json_flag:
        assert json.loads(result.stdout) == {"ok": False, "error": message, "exit_code": 2}
        assert result.stderr == f"error: {message}\n"
    else:
        assert result.stderr.endswith(f"\n\nError: {message}\n"), result.stderr


def test_a_require_list_naming_an_unknown_fix_is_json_under_json():
    """--require is read while the options are parsed: --json after it still holds."""
    result = CliRunner().invoke(main, ["verify", "--require", "nine", "--json"])
    assert result.exit_code == ConfigError.exit_code
    assert json.loads(result.stdout) == {
        "ok": False,
        "error": f"--require 'nine': not a fix ({registry().numbers}, a patch id or a probe)",
        "exit_code": ConfigError.exit_code,
    }


def test_identity_names_a_version_vllm_does_not_report():
    """A stamped build whose vllm.__version__ says otherwise is another vLLM (exit 14)."""
    ok = VersionIdentity("0.20.1+dflash.6.ab", "0.20.1+dflash.6.ab", "0.20.1+dflash.6.ab", True)
    assert ok.problem is None and "vllm.__version__ 0.20.1+dflash.6.ab" in ok.describe()
    shadowed = dataclasses.replace(ok, runtime="0.20.1")
    assert shadowed.problem is not None and "but the build stamped 0.20.1+dflash.6.ab" in (
        shadowed.problem
    )
    unstamped = VersionIdentity("0.20.1+dflash.3.ab", "0.20.1", None, True)
    assert unstamped.problem is None
    assert "cannot tell it from stock" in unstamped.describe()


@pytest.mark.parametrize(
    ("first", "second"),
    [("--python", "--site-packages"), ("--python", "--wheel"), ("--site-packages", "--wheel")],
)
def test_two_installs_named_at_once_are_a_usage_error(tmp_path, first, second):
    """Only one would be verified, the other passed over with exit 0: refused, both named."""
    wheel = tmp_path / "vllm-0.20.1-py3-none-any.whl"
    wheel.write_bytes(b"")
    value = {"--python": sys.executable, "--site-packages": str(tmp_path), "--wheel": str(wheel)}
    args = ["verify", first, value[first], second, value[second]]
    message = f"{first} and {second} each name an install to verify; give one"
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.endswith(f"\n\nError: {message}\n"), result.stderr
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 2, result.output
    assert json.loads(result.stdout) == {"ok": False, "error": message, "exit_code": 2}
