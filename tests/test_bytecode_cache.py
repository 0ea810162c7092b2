"""The bytecode check's kept verdicts, on a small site folder compiled by this interpreter:
a (source, code) pair found equal is not compiled again, and other code never hides behind
a kept pair."""

from __future__ import annotations

import importlib._bootstrap_external as bootstrap
import importlib.util
import py_compile
import sys
from pathlib import Path

from tooling.verifying.bytecode import check_bytecode

PYTHON = Path(sys.executable)


def site_with_module(tmp_path: Path) -> tuple[Path, Path]:
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("")
    source = site / "pkg" / "mod.py"
    source.write_text("def answer():\n    return 42\n")
    for path in (site / "pkg" / "__init__.py", source):
        py_compile.compile(str(path), doraise=True)
    return site, source


def test_a_pair_found_equal_is_known_the_next_time(tmp_path):
    site, _ = site_with_module(tmp_path)
    kept = tmp_path / "kept"
    first = check_bytecode(PYTHON, site, ["pkg"], kept)
    assert (first.checked, first.known, first.differ) == (2, 0, [])
    second = check_bytecode(PYTHON, site, ["pkg"], kept)
    assert (second.checked, second.known, second.differ) == (2, 2, [])
    assert "(2 known from earlier checks)" in second.describe()
    # Without a cache folder, everything is compiled.
    assert check_bytecode(PYTHON, site, ["pkg"]).known == 0


def test_other_code_under_a_kept_pairs_header_is_compiled_and_named(tmp_path):
    site, source = site_with_module(tmp_path)
    kept = tmp_path / "kept"
    check_bytecode(PYTHON, site, ["pkg"], kept)
    pyc = Path(importlib.util.cache_from_source(str(source)))
    stat = source.stat()
    evil = compile("def answer():\n    return 41\n", str(source), "exec")
    pyc.write_bytes(bootstrap._code_to_timestamp_pyc(evil, stat.st_mtime, stat.st_size))
    for _ in range(2):  # never kept: found again the second time
        got = check_bytecode(PYTHON, site, ["pkg"], kept)
        assert (got.checked, got.known) == (2, 1)
        assert got.differ == [(f"pkg/__pycache__/{pyc.name}", "timestamp")]
