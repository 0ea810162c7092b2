"""The fixed runner serves without a drafter: no read of ``self.drafter`` that a plain engine
reaches.

vLLM's ``GPUModelRunner`` sets ``self.drafter`` only with speculative decoding, and only on
the last pipeline rank. Patch 22's first form captured the drafter's graphs with
``isinstance(self.drafter, ...)`` in ``capture_model``, which every engine runs: a plain
engine of the fixed wheel died at start-up on the GPU with ``AttributeError: 'GPUModelRunner'
object has no attribute 'drafter'`` (2026-12-05's speed run). Capture needs a GPU, so on the
CPU this is read from the runner's source: every read of ``self.drafter`` must sit under a
test that names the drafter or speculative decoding, or after an early return on one. Stock
0.20.1 keeps that rule throughout; the test also shows it catching patch 22's first form.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNNER = Path("vllm/v1/worker/gpu_model_runner.py")
#: Words a guard's test holds when it decides whether the runner has a drafter.
GUARDS = ("drafter", "speculative_config", "spec_decode", "use_spec", "spec_config")


def _guarded(test: ast.expr) -> bool:
    return any(word in ast.unparse(test) for word in GUARDS)


def _returns_first(function: ast.FunctionDef, line: int) -> bool:
    """Whether ``function`` returns or raises on a guard before ``line``."""
    for stmt in function.body:
        if stmt.lineno >= line:
            return False
        ends = any(isinstance(s, ast.Return | ast.Raise) for s in getattr(stmt, "body", []))
        if isinstance(stmt, ast.If) and ends and _guarded(stmt.test):
            return True
    return False


def unguarded_drafter_reads(source: str) -> list[int]:
    """The lines of ``GPUModelRunner`` that read ``self.drafter`` outside any guard."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    runner = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner"
    )
    found = []
    for node in ast.walk(runner):
        if not (
            isinstance(node, ast.Attribute)
            and node.attr == "drafter"
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and isinstance(node.ctx, ast.Load)
        ):
            continue
        here: ast.AST = node
        while (above := parents.get(here)) is not None:
            test = getattr(above, "test", None)
            if test is not None and here is not test and _guarded(test):
                break
            if isinstance(above, ast.FunctionDef):
                if not _returns_first(above, node.lineno):
                    found.append(node.lineno)
                break
            here = above
    return found


#: Patch 22's first form of the capture, as it reached the GPU.
FIRST_FORM = """
class GPUModelRunner:
    def capture_model(self):
        if self.speculative_config:
            self.drafter.ready()
        if isinstance(self.drafter, DFlashProposer):
            self.drafter.capture_full_graphs()
"""


def test_the_rule_finds_patch_22s_first_form_and_nothing_guarded() -> None:
    assert unguarded_drafter_reads(FIRST_FORM) == [6]
    fixed = 'isinstance(getattr(self, "drafter", None),'
    guarded = FIRST_FORM.replace("isinstance(self.drafter,", fixed)
    assert unguarded_drafter_reads(guarded) == []


@pytest.mark.slow
def test_stock_and_fixed_runners_read_the_drafter_only_under_a_guard(
    upstream_0201, patched_0201
) -> None:
    stock = (upstream_0201.source_dir / RUNNER).read_text()
    fixed = (Path(patched_0201.work_dir) / RUNNER).read_text()
    assert stock.count("self.drafter") > 30  # the rule reads the real runner, not a stub
    assert unguarded_drafter_reads(stock) == []
    assert unguarded_drafter_reads(fixed) == []
