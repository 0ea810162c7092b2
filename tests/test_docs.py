"""The documentation: relative links resolve, README stays a front page, and
docs/reference/canary.md is what the renderer makes of a real ``patch status --json``."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tooling.canary_doc import TITLE, grouped_rows, release_label, render
from tooling.fetching.bases import load_bases

from .helpers import run_module

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
#: A real `tooling patch status --bases 0.20.1,0.22.0 --json`.
STATUS = DATA / "patch-status-0.20.1-0.22.0.json"

PAGES = sorted(
    [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md"],
) + sorted((ROOT / "docs").rglob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page``."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def status_two() -> dict:
    return json.loads(STATUS.read_text(encoding="utf-8"))


def ledger_ids() -> list[str]:
    ledger = tomllib.loads((ROOT / "patches" / "series.toml").read_text(encoding="utf-8"))
    return [p["id"] for p in ledger["patch"]]


def expand(label: str, order: list[str]) -> list[str]:
    """The releases one line's label stands for, in the run's order."""
    if " - " in label:
        first, last = label.split(" - ")
        return order[order.index(first) : order.index(last) + 1]
    return label.split(", ")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](#title) [gone](missing.md) [bad](#nothing) [web](https://x.org/y)\n"
        "```\n[in a fence](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    assert relative_links(page) == ["#title", "missing.md", "#nothing"]
    assert anchors(page) == {"title"}


def test_readme_is_a_front_page_naming_the_ci_test_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= 150
    ci_command = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert any(line.startswith(ci_command + " ") for line in readme), ci_command


def test_readme_has_one_row_per_patch_in_the_ledger() -> None:
    ids = ledger_ids()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (\d+) \| `([^`]+)` \|", readme, re.MULTILINE)
    assert rows == [(str(n), pid) for n, pid in enumerate(ids, start=1)]


def test_the_evidence_page_links_every_notebook_page() -> None:
    """A dated page added to docs/notebook/ and not to docs/evidence.md is a page no door
    reaches."""
    evidence = ROOT / "docs" / "evidence.md"
    linked = {(evidence.parent / t.partition("#")[0]).resolve() for t in relative_links(evidence)}
    pages = sorted((ROOT / "docs" / "notebook").glob("*.md"))
    assert pages and [p.name for p in pages if p.resolve() not in linked] == []


def test_the_evidence_page_has_every_figure_of_readmes_acceptance_table() -> None:
    """The README's figures of acceptance and speed, each on the evidence page beside its
    source: a figure changed in one place and not the other fails here."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("| engine | Qwen3, K = 3 |")[1].split("\n\n")[0]
    speed = re.search(r"Decode speed at K = 15 .*? at 64", readme, re.DOTALL)
    assert speed is not None
    # Decimals alone: "0.20.1" is a version, not a figure.
    figures = set(re.findall(r"(?<![\d.])\d+\.\d+(?![\d.])", table + speed.group(0)))
    assert len(figures) >= 20
    evidence = (ROOT / "docs" / "evidence.md").read_text(encoding="utf-8")
    assert sorted(f for f in figures if f not in evidence) == []


def test_the_canary_page_is_generated_for_this_series() -> None:
    """docs/reference/canary.md is written by make canary-docs: its header says so, and it has
    a column per patch of the ledger, so a patch added without running it again fails here."""
    page = (ROOT / "docs" / "reference" / "canary.md").read_text(encoding="utf-8")
    assert page.startswith(TITLE + "\n\nGenerated by `make canary-docs`")
    table = [line for line in page.splitlines() if line.startswith("| ")]
    columns = [c.strip() for c in table[0].strip("|").split("|")]
    assert columns == ["release", *(f"{n} {p}" for n, p in enumerate(ledger_ids(), 1))]
    statuses = {"applied", "already-applied", "superseded", "not-needed", "conflict", "error"}
    for row in table[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert len(cells) == len(columns) - 1
        assert {c.removesuffix(" (!)") for c in cells} <= statuses, row


def test_the_render_names_every_patch_and_release() -> None:
    status = status_two()
    header = next(line for line in render(status).splitlines() if line.startswith("| release"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns == ["release", *(f"{n} {p}" for n, p in enumerate(status["patches"], 1))]
    order = [e["base"] for e in status["bases"]]
    rows = grouped_rows(status)
    assert [b for row in rows for b in expand(row[0], order)] == order
    assert all(len(row) == len(columns) for row in rows)


def test_the_rows_are_the_runs_outcomes() -> None:
    """The fixture's run: every patch applied on the validated base; on 0.22.0 upstream's own
    fixes read superseded and the lines it rewrote conflict."""
    page = render(status_two())
    assert "| 0.20.1 | " + " | ".join(["applied"] * 11) + " |" in page
    row_0220 = (
        "superseded | conflict | applied | applied | superseded | applied | applied | conflict"
        " | applied | applied | conflict"
    )
    assert f"| 0.22.0 | {row_0220} |" in page


def test_neighbouring_releases_with_equal_cells_share_a_line() -> None:
    status = status_two()
    first = next(e for e in status["bases"] if e["base"] == "0.20.1")
    other = next(e for e in status["bases"] if e["base"] == "0.22.0")
    made = {
        "patches": status["patches"],
        "bases": [
            {**copy.deepcopy(first), "base": "0.20.0"},
            copy.deepcopy(first),
            {**copy.deepcopy(first), "base": "0.20.2"},
            copy.deepcopy(other),
            {**copy.deepcopy(first), "base": "0.23.0"},
            {"base": "0.24.0", "error": "no such release", "report": None},
        ],
    }
    rows = grouped_rows(made)
    assert [r[0] for r in rows] == ["0.20.0 - 0.20.2", "0.22.0", "0.23.0", "0.24.0"]
    assert rows[3][1:] == ["error"] * len(status["patches"])
    assert "- 0.24.0: no such release" in render(made)


def test_release_labels() -> None:
    assert release_label(["0.22.0"]) == "0.22.0"
    assert release_label(["0.22.0", "0.22.1"]) == "0.22.0, 0.22.1"
    assert release_label(["0.28.0", "0.29.0", "0.32.0"]) == "0.28.0 - 0.32.0"


def run_renderer(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_module("tooling.canary_doc", *args)


def bases_pinning(folder: Path, *versions: str) -> Path:
    """A copy of bases.toml that pins ``versions`` alone."""
    kept, keep = [], True
    for line in (ROOT / "patches" / "bases.toml").read_text().split("\n"):
        if line.startswith('[bases."'):
            keep = line.split('"')[1] in versions
        if keep:
            kept.append(line)
    path = folder / "bases.toml"
    path.write_text("\n".join(kept))
    return path


def test_the_command_writes_the_page(tmp_path: Path) -> None:
    out = tmp_path / "canary.md"
    done = run_renderer(STATUS, "-o", out, "--bases", bases_pinning(tmp_path, "0.20.1", "0.22.0"))
    assert done.returncode == 0, done.stderr
    assert out.read_text(encoding="utf-8") == render(status_two())


def test_a_matrix_of_fewer_releases_than_are_pinned_writes_no_page(tmp_path: Path) -> None:
    """A run of one base wrote a one-row page that still said "--bases all" and "every
    pinned release"."""
    out = tmp_path / "canary.md"
    done = run_renderer(STATUS, "-o", out)
    pinned = len(load_bases(ROOT / "patches" / "bases.toml").bases)
    assert done.returncode == 13
    assert done.stderr.startswith(f"error: {STATUS}: has no row for 0.20.0, 0.20.2, 0.21.0 and ")
    assert f" more of the {pinned} releases " in done.stderr and done.stderr.count("\n") == 1
    assert "`tooling patch status --bases all --json`" in done.stderr
    assert not out.exists()


def test_a_status_without_probes_or_patches_is_one_line(tmp_path: Path) -> None:
    unprobed = tmp_path / "unprobed.json"
    unprobed.write_text(json.dumps({**status_two(), "probed": False}), encoding="utf-8")
    no_patches = tmp_path / "no-patches.json"
    no_patches.write_text(
        json.dumps({k: v for k, v in status_two().items() if k != "patches"}), encoding="utf-8"
    )
    for bad, says in ((unprobed, "--no-probes"), (no_patches, "no list of patches")):
        done = run_renderer(bad, "-o", tmp_path / "page.md")
        assert done.returncode == 13
        assert done.stderr.count("\n") == 1 and str(bad) in done.stderr and says in done.stderr
    assert not (tmp_path / "page.md").exists()
