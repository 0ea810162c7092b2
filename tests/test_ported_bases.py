"""One ledger, several bases: on a release ``ported_bases`` lists, every fix names its own
code there (``[patch.on."BASE"]``): a port (its patch file in ``patches/BASE/``), superseded
(its probe must read present on the base) or not needed (the code path is gone). A build for
such a base refuses a fix that names none, in one line, before anything is fetched; the
canary tries it with its own patch file and reports what that comes to."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest

from tooling.errors import SeriesError
from tooling.fetching.upstream import Upstream
from tooling.patching.apply import apply_series
from tooling.patching.outcome import APPLIED, CONFLICT, NOT_NEEDED, SUPERSEDED
from tooling.patching.series import CodeState, load_ledger
from tooling.probing import PRESENT

from .helpers import PATCHES, apply_options, run_tooling

PORTED = "0.22.0"
#: The real ledger's line; a copy's names PORTED as well.
REAL_PORTED = 'ported_bases = ["0.34.0"]'


def _ledger(
    tmp_path: Path, ported: str, tables: dict[str, str], keep: tuple[str, ...] = ()
) -> Path:
    """A copy of ``patches/`` whose ledger lists ``ported`` in ported_bases and gives the
    patches named in ``tables`` those ``[patch.on."BASE"]`` bodies; with ``keep``, only those
    patches (in series order)."""
    folder = shutil.copytree(PATCHES, tmp_path / "patches")
    head, *blocks = (PATCHES / "series.toml").read_text().split("[[patch]]\n")
    kept = []
    for block in blocks:
        patch_id = re.search(r'^id = "([^"]+)"', block, re.M)
        assert patch_id is not None
        if keep and patch_id.group(1) not in keep:
            continue
        if keep:  # a shortened series: requirements outside it go too
            block = re.sub(r"^requires = .*\n", "", block, flags=re.M)
        body = tables.get(patch_id.group(1))
        if body is not None:
            block = block.rstrip("\n") + f'\n\n[patch.on."{ported}"]\n{body}\n\n'
        kept.append(block)
    head = head.replace(REAL_PORTED, f'ported_bases = ["{ported}", "0.34.0"]')
    (folder / "series.toml").write_text("[[patch]]\n".join([head, *kept]))
    return folder


def _port(folder: Path, base: str, patch_file: str) -> str:
    """The 0.20.1 patch file put in ``base``'s folder as that base's port; its ledger lines."""
    (folder / base).mkdir(exist_ok=True)
    port = folder / base / patch_file
    shutil.copyfile(folder / patch_file, port)
    digest = hashlib.sha256(port.read_bytes()).hexdigest()
    return (
        f'state = "port"\nwhy = "the same hunks apply"\nfile = "{base}/{patch_file}"\n'
        f'sha256 = "{digest}"'
    )


def _port_eagle_cache_drop(ledger: Path) -> None:
    """Give patch 3 a port on PORTED in ``ledger``: its own file, as the same hunks apply."""
    port_lines = _port(ledger, PORTED, "0003-eagle-cache-drop.patch")
    text = (ledger / "series.toml").read_text()
    text = text.replace(
        'probe = "eagle_cache_drop"\n',
        f'probe = "eagle_cache_drop"\n\n[patch.on."{PORTED}"]\n{port_lines}\n',
        1,
    )
    (ledger / "series.toml").write_text(text)


def test_a_ledger_reads_each_fixs_code_on_a_ported_base(tmp_path):
    folder = tmp_path / "p"
    folder.mkdir()
    ledger = _ledger(
        folder,
        PORTED,
        {
            "dflash-layer-id-offset": 'state = "superseded"\nwhy = "upstream #40727"',
            "dflash-swa-config": 'state = "not-needed"\nwhy = "the V1 path is gone"',
        },
    )
    _port_eagle_cache_drop(ledger)
    series = load_ledger(ledger)
    assert series.ported_bases == (PORTED, "0.34.0")
    # Another release: the patch files as they are, the series unchanged.
    assert series.for_base("0.20.1", strict=True) is series
    lenient = series.for_base(PORTED, strict=False)
    first, second, third, fourth = lenient.patches[:4]
    assert (first.expect, second.expect, third.expect, fourth.expect) == (
        CodeState.SUPERSEDED,
        CodeState.NOT_NEEDED,
        CodeState.PORT,
        None,
    )
    assert third.ledger_file == f"{PORTED}/0003-eagle-cache-drop.patch"
    assert third.file == (ledger / PORTED / "0003-eagle-cache-drop.patch").resolve()
    assert [p.id for p in lenient.carried][:2] == ["eagle-cache-drop", "dflash-lookahead-slots"]
    # The identity of the series on that base differs from the validated line's.
    assert lenient.digest != series.digest
    # Patch 5 is written on patch 2, which brings no code there: the requirement goes.
    assert lenient.get("dflash-fp8-kv-cache").requires == ()
    with pytest.raises(
        SeriesError,
        match=rf"^base {PORTED}: fix dflash-lookahead-slots has no code for it \(series.toml "
        rf'names no port, superseded or not-needed in \[patch.on."{PORTED}"\]\); --skip '
        r"dflash-lookahead-slots builds without it, named in the version$",
    ):
        series.for_base(PORTED, strict=True)


#: (the ``[patch.on]`` body given to patch 1, what the one line says).
MALFORMED = [
    ('state = "gone"\nwhy = "x"', "state 'gone' is not one of port, superseded, not-needed"),
    ('state = "superseded"', "missing key 'why'"),
    ('state = "superseded"\nwhy = " "', "why is empty"),
    ('state = "not-needed"\nwhy = "x"\nfile = "0.22.0/a.patch"', "file is for a port"),
    (
        'state = "port"\nwhy = "x"\nfile = "a.patch"\nsha256 = "' + "0" * 64 + '"',
        "is not 0.22.0/NAME",
    ),
    (
        'state = "port"\nwhy = "x"\nfile = "0.22.0/../a.patch"\nsha256 = "' + "0" * 64 + '"',
        "is not",
    ),
    ('state = "port"\nwhy = "x"\nfile = "0.22.0/a.patch"', "missing key 'sha256'"),
    (
        'state = "port"\nwhy = "x"\nfile = "0.22.0/a.patch"\nsha256 = "' + "0" * 64 + '"',
        "is missing",
    ),
    ('state = "superseded"\nwhy = "x"\nprobe = "y"', "unknown key 'probe'"),
]


@pytest.mark.parametrize(("body", "why"), MALFORMED)
def test_a_wrong_code_table_is_one_line_naming_it(tmp_path, body, why):
    ledger = _ledger(tmp_path, PORTED, {"dflash-layer-id-offset": body})
    with pytest.raises(SeriesError, match=re.escape(why)) as caught:
        load_ledger(ledger)
    assert "\n" not in str(caught.value)


def test_code_for_a_base_not_ported_or_not_pinned_is_refused(tmp_path):
    ledger = _ledger(
        tmp_path / "a", PORTED, {"dflash-layer-id-offset": 'state = "superseded"\nwhy = "x"'}
    )
    text = (ledger / "series.toml").read_text()
    (ledger / "series.toml").write_text(
        text.replace(f'ported_bases = ["{PORTED}", "0.34.0"]', 'ported_bases = ["0.34.0"]')
    )
    with pytest.raises(
        SeriesError, match=rf"names code for {PORTED} .*which ported_bases does not list"
    ):
        load_ledger(ledger)
    (ledger / "series.toml").write_text(
        text.replace(
            f'ported_bases = ["{PORTED}", "0.34.0"]', 'ported_bases = ["9.9.9", "0.22.0", "0.34.0"]'
        )
    )
    with pytest.raises(SeriesError, match="ported_bases '9.9.9' is not a release bases.toml pins"):
        load_ledger(ledger)
    (ledger / "series.toml").write_text(
        text.replace(
            f'ported_bases = ["{PORTED}", "0.34.0"]',
            'ported_bases = ["0.20.1", "0.22.0", "0.34.0"]',
        )
    )
    with pytest.raises(SeriesError, match="ported_bases lists the validated base 0.20.1"):
        load_ledger(ledger)


def test_a_build_for_a_ported_base_refuses_an_undecided_fix_before_fetching(tmp_path):
    ledger = _ledger(
        tmp_path, "0.33.0", {"dflash-layer-id-offset": 'state = "superseded"\nwhy = "x"'}
    )
    cache = tmp_path / "empty-cache"
    result = run_tooling(
        "--offline", "--cache-dir", str(cache), "--patches-dir", str(ledger),
        "build", "--base", "0.33.0", "--no-probes", "--dist", str(tmp_path / "dist"),
    )  # fmt: skip
    assert result.returncode == 10, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "error: base 0.33.0: fix dflash-swa-config has no code for it (series.toml names no "
        'port, superseded or not-needed in [patch.on."0.33.0"]); --skip dflash-swa-config '
        "builds without it, named in the version"
    ]
    assert not (tmp_path / "dist").exists()
    assert not any(cache.rglob("*.tar.gz")) if cache.exists() else True


def test_what_a_candidate_build_leaves_out_is_every_fix_with_no_code_on_the_base(tmp_path):
    """The GPU host builds a ported base's candidate with ``--skip`` of these (its version
    names them); off a ported base nothing is left out."""
    ledger = load_ledger(
        _ledger(tmp_path, "0.33.0", {"dflash-layer-id-offset": 'state = "superseded"\nwhy = "x"'})
    )
    absent = ledger.without_code_on("0.33.0")
    assert "dflash-layer-id-offset" not in absent
    assert absent == tuple(p.id for p in ledger.patches[1:])
    assert ledger.without_code_on("0.20.1") == ()
    real = load_ledger(PATCHES)
    assert real.without_code_on("0.34.0") == (
        "piecewise-spec-sizes",
        "gdn-spec-replay",
    )


@pytest.mark.slow
def test_on_a_ported_base_each_fix_comes_to_what_the_ledger_says(
    tmp_path, catalog, fetch_release, probe_python, cache
):
    """A real 0.22.0 tree with the real probes: fix 1 superseded there (its probe reads
    present), fix 2 not needed, fix 3 a port that applies, and fix 4 called superseded
    although 0.22.0 still has its defect: a conflict, never a silent skip."""
    keep = (
        "dflash-layer-id-offset",
        "dflash-swa-config",
        "eagle-cache-drop",
        "dflash-lookahead-slots",
    )
    ledger = _ledger(
        tmp_path,
        PORTED,
        {
            "dflash-layer-id-offset": 'state = "superseded"\nwhy = "upstream #40727"',
            "dflash-swa-config": 'state = "not-needed"\nwhy = "a test says so"',
            "dflash-lookahead-slots": 'state = "superseded"\nwhy = "a claim the tree refutes"',
        },
        keep=keep,
    )
    _port_eagle_cache_drop(ledger)
    series = load_ledger(ledger)
    upstream: Upstream = fetch_release(catalog.get(PORTED), with_wheel=False)
    report = apply_series(
        upstream, series, tmp_path / "work", apply_options(probe_python, cache, keep_going=True)
    )
    offset = report.outcome("dflash-layer-id-offset")
    assert offset.status == SUPERSEDED and offset.commit is None
    assert "as the ledger says" in offset.message
    swa = report.outcome("dflash-swa-config")
    assert swa.status == NOT_NEEDED and swa.message == f"not needed on {PORTED}: a test says so"
    eagle = report.outcome("eagle-cache-drop")
    assert eagle.status == APPLIED and eagle.patch_file == f"{PORTED}/0003-eagle-cache-drop.patch"
    assert eagle.probe_after is not None and eagle.probe_after["status"] == PRESENT
    slots = report.outcome("dflash-lookahead-slots")
    assert slots.status == CONFLICT and slots.commit is None
    assert slots.message.startswith(
        "series.toml says superseded here, but probe lookahead_slots reads absent"
    )
    assert not report.ok
    assert report.series_digest == series.for_base(PORTED, strict=False).digest


@pytest.mark.slow
def test_the_ledgers_claims_for_0340_hold_on_its_tree(
    tmp_path, catalog, fetch_release, probe_python, cache
):
    """The real ledger on the real 0.34.0 with the real probes: each fix it decides there comes
    to what it says (superseded ones read present on stock 0.34.0, each port goes in and its
    probe then reads present, not-needed ones are left out), and a build names the first fix
    still undecided."""
    series = load_ledger(PATCHES)
    upstream: Upstream = fetch_release(catalog.get("0.34.0"), with_wheel=False)
    report = apply_series(
        upstream, series, tmp_path / "work", apply_options(probe_python, cache, keep_going=True)
    )
    resolved = series.for_base("0.34.0", strict=False)
    expected = {None: CONFLICT, CodeState.SUPERSEDED: SUPERSEDED, CodeState.PORT: APPLIED}
    expected[CodeState.NOT_NEEDED] = NOT_NEEDED
    for patch in resolved.patches:
        outcome = report.outcome(patch.id)
        assert outcome.status == expected[patch.expect], (patch.id, outcome.message)
        if patch.expect in (CodeState.SUPERSEDED, CodeState.PORT):
            assert outcome.problem is None, (patch.id, outcome.problem)
            assert outcome.probe_after is not None and outcome.probe_after["status"] == PRESENT
        if patch.expect is CodeState.PORT:
            assert outcome.probe_before is not None, patch.id
            assert outcome.probe_before["status"] != PRESENT, (patch.id, "a port of no defect")
    undecided = [p.id for p in resolved.patches if p.expect is None]
    assert undecided, "every fix decided: make this test build the 0.34.0 wheel instead"
    with pytest.raises(SeriesError, match=rf"^base 0.34.0: fix {undecided[0]} has no code"):
        series.for_base("0.34.0", strict=True)
