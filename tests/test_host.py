"""``tooling host``'s steps as data and plans (ablations, variants, session steps), checked on
the real series and the real scripts' usage lines so the tables cannot drift from what the host
runs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tooling.errors import HostUsageError
from tooling.host.session import STEPS
from tooling.host.setup import ablations
from tooling.host.variants import VARIANTS, SmokeSettings, smoke_args, smoke_site
from tooling.patching.series import load_ledger
from tooling.paths import REPO_DIR

from .helpers import run_gpu_script

GPU = REPO_DIR / "ci" / "gpu"
SERIES = load_ledger(REPO_DIR / "patches")


def _usage(script: str) -> str:
    text = (GPU / script).read_text()
    return re.search(r'\. "\$here/args\.sh" "([^"]*)"', text).group(1)  # type: ignore[union-attr]


def test_every_patch_has_its_ablation_with_the_patches_written_on_it() -> None:
    planned = ablations(SERIES, None)
    assert [a.patch for a in planned] == [p.id for p in SERIES.patches]
    for ablation in planned:
        # What the series itself accepts leaving out together (it refuses less).
        kept = SERIES.without(list(ablation.skipped))
        assert {p.id for p in kept.patches} == {p.id for p in SERIES.patches} - set(
            ablation.skipped
        )
        written_on = [p.id for p in SERIES.patches if ablation.patch in p.requires]
        assert set(written_on) <= set(ablation.skipped[1:])
        assert ablation.engine == f"no-{ablation.patch}"
    # series.toml has patches written on others: their ablations skip more than one, and
    # a chain (33 on 32 on 22 on 5 on 2, and 40 on 22) is left out whole.
    assert any(len(a.skipped) > 1 for a in planned)
    swa = next(a for a in planned if a.patch == "dflash-swa-config")
    assert swa.skipped == (
        "dflash-swa-config",
        "dflash-fp8-kv-cache",
        "drafter-full-graphs",
        "gdn-spec-replay",
        "join-hold",
        "dflash-step-graphs",
    )


def test_ablations_asked_for_are_those_alone() -> None:
    first, second = SERIES.patches[0].id, SERIES.patches[1].id
    # A comma-joined group (as the scripts printed them) counts by its first id.
    assert [a.patch for a in ablations(SERIES, [f"{second},{first}", first])] == [second, first]
    assert ablations(SERIES, []) == []
    with pytest.raises(HostUsageError, match="ABLATIONS: no-such-patch is not a patch"):
        ablations(SERIES, ["no-such-patch"])


def test_an_unknown_ablation_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    work = tmp_path / "work"
    done = run_gpu_script(
        "host-setup.sh", str(tmp_path), "build", work=work, ABLATIONS="gdn-gate-gathr"
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "error: host-setup.sh: ABLATIONS: gdn-gate-gathr is not a patch of the series\n"
    )
    assert not work.exists()


def test_the_tables_are_the_usage_lines() -> None:
    """The scripts' usage lines name the variants and the session's steps the tables hold."""
    smoke = _usage("production-smoke.sh").split()[-1]
    assert smoke.split("|") == list(VARIANTS)
    session = re.search(r"\[([a-z0-9|-]+) \.\.\.\]", _usage("hybrid-session.sh"))
    assert session and session.group(1).split("|") == list(STEPS)


def test_each_variant_asks_the_smoke_what_the_scripts_asked() -> None:
    settings = SmokeSettings(
        patched_site="/e/patched:/site", stock_site="/e/stock", pair="/p", time_limit=500
    )
    limit = ["--time-limit", "500"]
    assert smoke_args(VARIANTS["default"], settings) == ["--tiny", *limit]
    # The warm cache's other wheel: stock whole, or the patched site's first folder.
    assert smoke_args(VARIANTS["warm"], settings)[3:7] == [
        "--warm-cache",
        "--stock-site",
        "/e/stock",
        "--no-load",
    ]
    assert "/e/patched" in smoke_args(VARIANTS["stock-warm"], settings)
    assert smoke_site(VARIANTS["stock-warm"], settings) == "/e/stock:/e/patched:/site"
    assert smoke_args(VARIANTS["pair"], settings) == [
        *limit,
        "--target",
        "/p/target",
        "--drafter",
        "/p/drafter",
        "--num-speculative-tokens",
        "15",
    ]
    more = SmokeSettings(patched_site="/s", more=("--quick",))
    assert smoke_args(VARIANTS["seed-full"], more) == [
        "--tiny",
        "--tiny-arch",
        "seed",
        "--tiny-hidden-size",
        "5120",
        "--num-speculative-tokens",
        "15",
        "--quick",
    ]


def test_the_speed_session_steps_wait_for_the_pair_and_build_the_ablations_call_1_serves() -> None:
    """``start PARTS speed trained-1``: one session's speed work, the engines built while the
    recipe trains, then the speed run on the pair, then its first call with the ablations."""
    from tooling.host.session import Kind
    from tooling.host.speed import SPEED_ARGS

    assert STEPS["speed"].kind is Kind.SPEED and STEPS["trained-1"].calls == "1"
    assert STEPS["trained-1"].kind is Kind.TRAINED and not STEPS["trained"].calls
    assert "--interleave" in SPEED_ARGS and "--sustained" in SPEED_ARGS
    engines = SPEED_ARGS[SPEED_ARGS.index("--engines") + 1].split(",")
    from tooling.trained.speed import ENGINES

    assert set(engines) <= set(ENGINES) and {"plain-stock", "plain", "dflash"} <= set(engines)


def test_the_locate_step_runs_a_shorter_speed_run_and_one_speed_step_a_session() -> None:
    """``speed-locate``: plain beside drafting off above 8 requests, at the levels around
    where drafting stops paying, the one of 64 profiled; it writes the speed step's run
    folder, so a session takes one of the two."""
    from tooling.host.session import Kind, check_steps
    from tooling.host.speed import LOCATE_ARGS, LOCATE_ENGINES, speed_args
    from tooling.trained.speed import ENGINES

    assert STEPS["speed-locate"].kind is Kind.SPEED
    args = speed_args("locate")
    assert args == LOCATE_ARGS and "--sustained" in args
    assert args[args.index("--levels") + 1] == "1,8,16,64"
    assert args[args.index("--profile-levels") + 1] == "64"
    assert set(LOCATE_ENGINES) <= set(ENGINES) and "dflash-off-above-8" in LOCATE_ENGINES
    budget = ENGINES["dflash-off-above-8"].speculative_args
    assert budget["num_speculative_tokens_per_batch_size"] == [[1, 8, 15], [9, 1024, 0]]
    assert speed_args("")[-2:] == ("--profile-levels", "1,64")
    assert speed_args("shape")[-2:] == ("--profile-levels", "1,16,64")
    check_steps(["speed-locate", "trained-1", "fuzz-trained"])
    # Two speed steps share the pair's run folder: the later run sets the earlier one's
    # figures aside (``tooling.trained.speed``) and the wait brings back both.
    check_steps(["speed-hold", "speed-graphs"])


def test_a_session_builds_the_installs_its_steps_serve_and_fuzzes_beside_the_training() -> None:
    """The speed run's ablated engines (``no-<patch>`` sites) are built with the calls'
    ablations, each once; a session without the calls or the speed run builds none;
    ``fuzz-seed`` is a step of its own, before the pair is needed."""
    from tooling.host.session import Kind, session_ablations
    from tooling.host.speed import SPEED_ENGINES
    from tooling.host.trained import trained_ablations
    from tooling.trained.speed import ENGINES

    assert ENGINES["dflash-no-gdn-groups"].site == "no-gdn-metadata-groups"
    speed = [
        ENGINES[e].site.removeprefix("no-")
        for e in SPEED_ENGINES
        if ENGINES[e].site.startswith("no-")
    ]
    both = session_ablations(["fuzz-seed", "speed", "trained-1"])
    assert len(both) == len(set(both)) and set(both) == {*trained_ablations(), *speed}
    assert session_ablations(["speed"]) == speed
    # The same engines on the recipe's shapes, drawn with random weights: no recipe.
    assert session_ablations(["speed-shape"]) == speed
    assert STEPS["speed-shape"].kind is Kind.SPEED_SHAPE
    assert session_ablations(["trained"]) == trained_ablations()
    assert session_ablations(["seed", "fuzz-seed"]) == []
    assert STEPS["fuzz-seed"].kind is Kind.FUZZ


def test_a_default_part_fits_one_call_beside_the_checkout() -> None:
    """A staging call carries the checkout's tracked files with one part; the checkout grows,
    so its size is read here, with 2 MiB to spare."""
    from tooling.host.parts import CALL_BYTES, PART_BYTES
    from tooling.paths import REPO_DIR

    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO_DIR, capture_output=True, check=True
    ).stdout.split(b"\0")
    tracked = sum((REPO_DIR / n.decode()).stat().st_size for n in names if n)
    assert tracked > 1 << 20, "the checkout's files were not read"
    assert tracked + PART_BYTES + (2 << 20) <= CALL_BYTES, f"checkout {tracked} bytes"
