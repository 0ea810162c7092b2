"""Hunk parsing and placement (pure)."""

from __future__ import annotations

from tooling.patching.hunks import parse_diff, place_hunk

DIFF = """\
diff --git a/pkg/mod.py b/pkg/mod.py
index 1111111..2222222 100644
--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -2,3 +2,4 @@ def f():
 a = 1
-b = 2
+b = 3
+c = 4
 d = 5
@@ -10,2 +11,2 @@ def g():
 x = 1
-y = 2
+y = 3
"""


def test_parse_diff_reads_files_and_hunks():
    (file_diff,) = parse_diff(DIFF)
    assert file_diff.path == "pkg/mod.py"
    first, second = file_diff.hunks
    assert (first.index, first.old_start, first.header) == (1, 2, " def f():")
    assert first.old_lines == ("a = 1", "b = 2", "d = 5")
    assert first.new_lines == ("a = 1", "b = 3", "c = 4", "d = 5")
    assert second.old_lines == ("x = 1", "y = 2")


def test_place_hunk_finds_moved_text_and_reports_the_offset():
    (file_diff,) = parse_diff(DIFF)
    lines = ["# new"] * 5 + ["top", "a = 1", "b = 2", "d = 5"]
    placement = place_hunk(lines, file_diff.hunks[0])
    assert placement.found_at == 7 and placement.moved_by == 5
    assert "moved by +5" in placement.describe()


def test_place_hunk_names_the_first_line_that_changed():
    (file_diff,) = parse_diff(DIFF)
    lines = ["top", "a = 1", "b = 20", "d = 5"]
    placement = place_hunk(lines, file_diff.hunks[0])
    assert placement.found_at is None
    assert placement.describe() == (
        "pkg/mod.py hunk #1 (def f():): line 3 expected 'b = 2', found 'b = 20'"
    )


def test_place_hunk_on_a_short_file():
    (file_diff,) = parse_diff(DIFF)
    assert "file too short" in place_hunk(["x = 1"], file_diff.hunks[1]).describe()
