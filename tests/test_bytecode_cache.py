"""The bytecode check's kept verdicts, on a small site folder compiled by this interpreter:
a (source, code) pair found equal is not compiled again, and other code never hides behind
a kept pair."""

from __future__ import annotations

import importlib._bootstrap_external as bootstrap
import importlib.util
import py_compile
import subprocess
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
        assert got.differ == [(f"pkg/__pycache__/{pyc.name}", "pkg/mod.py", "timestamp")]


def test_bytecode_under_a_prefix_a_pth_sets_is_the_bytecode_checked(tmp_path):
    """A ``.pth`` of the environment moves where its interpreter reads bytecode: a pyc of
    other code there runs, and the clean ``__pycache__`` beside the source is never read."""
    import venv

    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "pkg").mkdir()
    (site / "pkg" / "__init__.py").write_text("")
    source = site / "pkg" / "mod.py"
    source.write_text("def answer():\n    return 42\n")
    py_compile.compile(str(source), doraise=True)  # the clean one, in __pycache__
    prefix = tmp_path / "pfx"
    (site / "redirect.pth").write_text(f"import sys; sys.pycache_prefix = {str(prefix)!r}\n")
    pyc = Path(str(prefix) + str(source.with_suffix(f".{sys.implementation.cache_tag}.pyc")))
    pyc.parent.mkdir(parents=True)
    stat = source.stat()
    evil = compile("def answer():\n    return 41\n", str(source), "exec")
    pyc.write_bytes(bootstrap._code_to_timestamp_pyc(evil, stat.st_mtime, stat.st_size))
    ran = subprocess.run(
        [str(python), "-c", "import pkg.mod; print(pkg.mod.answer())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert ran.stdout.strip() == "41"  # what the environment really runs
    got = check_bytecode(python, site, ["pkg"])
    assert got.prefix == str(prefix)
    assert got.differ == [(str(pyc), "pkg/mod.py", "timestamp")]
    assert got.stale == 1  # the clean pyc in __pycache__, which nothing reads
    assert f"(pycache prefix {prefix})" in got.describe()
