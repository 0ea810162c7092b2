"""The house's size rules hold for every module the next engineer carries on: no module over
500 lines and no function over 120, in the toolchain, its tests, its benchmarks and its CI.
The notebook's scripts are left out: each is the record of what one session ran."""

from __future__ import annotations

import ast
from pathlib import Path

from tooling.paths import REPO_DIR

MODULE_LINES = 500
FUNCTION_LINES = 120
ROOTS = ("tooling", "tests", "bench", "ci", ".ci")


def _modules() -> list[Path]:
    found = []
    for root in ROOTS:
        folder = REPO_DIR / root
        if folder.is_dir():
            found += [p for p in folder.rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(found)


def _long_functions(path: Path, base: Path = REPO_DIR) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [
        f"{path.relative_to(base)}:{node.lineno} {node.name} ({length} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > FUNCTION_LINES
    ]


def test_no_module_is_over_500_lines_and_no_function_over_120() -> None:
    modules = _modules()
    assert any(p.name == "test_house_sizes.py" for p in modules)
    long_modules = [
        f"{p.relative_to(REPO_DIR)} ({n} lines)"
        for p in modules
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MODULE_LINES
    ]
    long_functions = [line for p in modules for line in _long_functions(p)]
    assert long_modules == []
    assert long_functions == []


def test_the_rule_finds_a_long_function_where_it_stands(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(FUNCTION_LINES))
    module = tmp_path / "long.py"
    module.write_text(
        f"def short():\n    pass\n\n\nclass A:\n    def long(self):\n{body}\n",
        encoding="utf-8",
    )
    assert _long_functions(module, tmp_path) == [f"long.py:6 long ({FUNCTION_LINES + 1} lines)"]
