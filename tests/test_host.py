"""``tooling host`` (``tooling/host``): the GPU host's steps as data and plans, checked on the
real series and the real scripts' usage lines, and its children shown under ``-v``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tooling.errors import HostUsageError
from tooling.host.session import STEPS
from tooling.host.setup import ablations
from tooling.host.variants import VARIANTS, SmokeSettings, smoke_args, smoke_site
from tooling.patching.series import load_ledger
from tooling.paths import REPO_DIR
from tooling.release.split import split_bundle

from .helpers import HANG_GUARD_S, run_gpu_script

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
    # a chain (33 on 32 on 22 on 5 on 2) is left out whole.
    assert any(len(a.skipped) > 1 for a in planned)
    swa = next(a for a in planned if a.patch == "dflash-swa-config")
    assert swa.skipped == (
        "dflash-swa-config",
        "dflash-fp8-kv-cache",
        "drafter-full-graphs",
        "gdn-spec-replay",
        "join-hold",
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


def _pair_parts(tmp_path: Path) -> Path:
    pair = tmp_path / "made" / "hybrid-pair"
    pair.mkdir(parents=True)
    (pair / "summary.json").write_text("{}")
    parts, _ = split_bundle(pair, tmp_path / "parts", 1 << 20, show_progress=False)
    return parts


def test_verbose_shows_each_child_it_runs(tmp_path: Path) -> None:
    parts, work = _pair_parts(tmp_path), tmp_path / "work"
    done = subprocess.run(
        [sys.executable, "-m", "tooling", "-v", "host", "trained", "--", "import-pair", str(parts)],
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "WORK": str(work)},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        cwd=REPO_DIR,
    )
    assert done.returncode == 0, done.stderr
    assert f"start python3 {parts}/join.py {work}/pair-import" in done.stderr
    assert "start du -sh" in done.stderr
    assert done.stdout.startswith("trained pair carried in: ")
    assert (work / "hybrid-pair" / "summary.json").is_file()


def test_a_session_uses_the_pair_already_in_place_before_carrying_or_training_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second session on one machine finds the first one's pair: it neither carries the
    parts in again (which would refuse, the folder being there) nor starts the training."""
    from tooling.host.layout import Layout
    from tooling.host.trained import TrainSettings, provide_pair

    parts, layout = _pair_parts(tmp_path), Layout(tmp_path / "work")
    settings = TrainSettings()
    provide_pair(layout, parts, settings)
    assert "trained pair carried in: " in capsys.readouterr().out
    provide_pair(layout, parts, settings)
    provide_pair(layout, None, settings)
    said = capsys.readouterr().out
    assert said.count(f"trained pair: already in {layout.pair}") == 2
    assert "training started" not in said and not (layout.work / "train-extras").exists()


def test_a_call_past_the_pairs_last_is_refused(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "hybrid-pair").mkdir(parents=True)
    (work / "hybrid-pair" / "summary.json").write_text("{}")
    out.mkdir()
    done = run_gpu_script("trained-hybrid.sh", "export-pair", "1", work=work, out=out)
    assert (done.returncode, done.stderr) == (2, "error: CALL 1 past the last, 0\n")
    assert list(out.iterdir()) == []


def test_a_steps_generated_weights_go_and_its_reports_stay(tmp_path: Path) -> None:
    """The smoke writes its pair's weights a folder below ``models/``: they were found only
    directly in it."""
    from tooling.host.session import generated_weights

    step = tmp_path / "seed-full"
    deep = step / "seed-full" / "models" / "target" / "model-00001.safetensors"
    flat = step / "pair" / "models" / "model.safetensors"
    kept = [step / "seed-full" / "report.json", step / "user" / "model.safetensors"]
    for path in (deep, flat, *kept):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    assert sorted(generated_weights(step)) == sorted([deep, flat])


def test_the_variants_sharing_a_gpu_run_at_once_under_one_deadline(tmp_path: Path) -> None:
    """``production-smoke-all.sh``: each variant a smoke of its own (dry runs here, their
    plans written as on the host), the shared deadline and fixed KV cache in each plan, every
    variant's lines printed under its name."""
    out = tmp_path / "out"
    done = run_gpu_script(
        "production-smoke-all.sh",
        work=tmp_path / "work",
        out=out,
        cwd=tmp_path,
        PATCHED_SITE="site",
        STOCK_SITE="stock",
        VARIANTS="default qwen3",
        SMOKE_ARGS="--dry-run --gpus 1x139",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("all variants done in ")
    assert lines[1] == "=== default" and lines[2].startswith("production smoke default: exit 0")
    assert "=== qwen3" in lines
    for name in ("default", "qwen3"):
        plan = json.loads((out / f"{name}.json").read_text())["plan"]
        assert plan["time_limit_s"] == 500
        assert plan["engine"]["kv_cache_memory_bytes"] == 4 << 30
        assert plan["engine"]["gpu_memory_utilization"] == 0.1
        assert (out / f"{name}.summary").is_file()


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


def test_the_speed_wait_brings_back_each_run_a_session_made_on_one_pair(tmp_path: Path) -> None:
    """A run set aside by a later one in the same folder comes back too, each with its
    report, in the archive's folder of its own."""
    import tarfile

    from tooling.host.layout import Layout
    from tooling.host.speed import ARCHIVE, wait

    layout = Layout(tmp_path / "work")
    work = layout.work / "speed" / "hybrid-pair"
    (work / "earlier-1").mkdir(parents=True)
    for folder, engine in ((work / "earlier-1", "dflash-hold"), (work, "dflash-drafter-graphs")):
        (folder / "engines.json").write_text("[]")
        (folder / f"{engine}.out.json").write_text("{}")
    out = tmp_path / "out"
    assert wait(layout, 0, out) == 0
    with tarfile.open(out / ARCHIVE) as archive:
        names = set(archive.getnames())
    assert "hybrid-pair/earlier-1/dflash-hold.out.json" in names
    assert "hybrid-pair/dflash-drafter-graphs.out.json" in names
    assert (out / "hybrid-pair-report.md").is_file()
    assert (out / "hybrid-pair-earlier-1-report.md").is_file()


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


def test_the_fuzz_steps_campaigns_draw_a_new_seed_each_day() -> None:
    import time

    from tooling.host.session import FUZZ_ARGS, fuzz_args

    day = time.strptime("2026-12-05", "%Y-%m-%d")
    args = fuzz_args(day)
    assert args[: len(FUZZ_ARGS)] == FUZZ_ARGS
    assert args[-2:] == ("--seed", "20261205")
    assert fuzz_args(time.strptime("2026-12-06", "%Y-%m-%d"))[-1] != args[-1]


def test_each_fuzz_step_names_its_pair_and_its_campaigns_options() -> None:
    """``fuzz-seed`` draws on the seed-shaped pair in noise mode, ``fuzz-trained`` on the
    trained pair, lossless and held to the recipe's reference acceptance, ``fuzz-replay``
    serves every kept GPU case again on the seed-shaped pair; a replay with no case is
    refused before anything starts."""
    import time

    from tooling.errors import HostStepError
    from tooling.host.session import FUZZ_NOISE, GPU_CASES, fuzz_args, fuzz_settings

    day = time.strptime("2026-12-05", "%Y-%m-%d")
    assert fuzz_settings("seed", day) == ("seed", fuzz_settings("seed", day)[1])
    which, seed = fuzz_settings("seed", day)
    assert (which, seed.noise, seed.args) == ("seed", FUZZ_NOISE, fuzz_args(day))
    which, trained = fuzz_settings("trained", day, reference=4.2834)
    assert which == "trained" and trained.noise is None
    assert trained.args == (*fuzz_args(day), "--reference-acceptance", "4.283")
    assert "--reference-acceptance" not in fuzz_settings("trained", day)[1].args
    kept = tuple(sorted(GPU_CASES.glob("*.json")))
    assert kept, "the crash the GPU fuzzer found is kept"
    which, replay = fuzz_settings("replay", day, cases=kept)
    assert which == "seed" and replay.noise == FUZZ_NOISE and "--seed" not in replay.args
    assert [replay.args[i + 1] for i, a in enumerate(replay.args) if a == "--replay"] == [
        str(c) for c in kept
    ]
    with pytest.raises(HostStepError, match="no kept GPU case"):
        fuzz_settings("replay", day)
    assert {STEPS[s].variant for s in ("fuzz-seed", "fuzz-trained", "fuzz-replay")} == {
        "seed",
        "trained",
        "replay",
    }


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


def test_the_verify_step_runs_tooling_verify_on_each_install_and_keeps_its_lines(
    tmp_path: Path,
) -> None:
    """``verify`` runs the real ``tooling verify`` on the stock and the patched install, each
    into a text of its own; an install with no vLLM is an error, not a verdict, and the
    step's exit names it (a missing fix, 15, would be a verdict)."""
    import os

    from tooling.host.layout import Layout
    from tooling.host.session import STEPS, _verify

    layout = Layout(tmp_path / "work")
    for engine in ("stock", "patched"):
        layout.engine(engine).mkdir(parents=True)
    (layout.session).mkdir(parents=True)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    code = _verify(layout, STEPS["verify"], layout.env(None, PATH=path))
    assert code == 16
    for engine in ("stock", "patched"):
        text = (layout.session / f"verify-{engine}.txt").read_text()
        assert text.strip() == f"error: no vllm-*.dist-info in {layout.engine(engine)}"


@pytest.mark.slow
def test_the_kernels_step_refuses_without_a_gpu_and_its_distance_is_at_a_rows_scale(
    tmp_path: Path, probe_python: Path
) -> None:
    """``kernels`` runs its checks in the fixed engine's interpreter (here the probes' CPU
    one): with no CUDA device it says so in one line, exits 2 and writes no report. Patch
    37's distance is in steps of the cache's format at each head row's scale."""
    import os

    from tooling.host.kernels import NO_CUDA_EXIT
    from tooling.host.layout import Layout
    from tooling.host.session import _kernel

    layout = Layout(tmp_path / "work")
    layout.session.mkdir(parents=True)
    path = f"{probe_python.parent}{os.pathsep}{os.environ['PATH']}"
    env = layout.env(None, PATH=path, PATCHED_SITE=str(tmp_path / "site"))
    env["CUDA_VISIBLE_DEVICES"] = ""
    assert _kernel(layout, STEPS["kernels"], env) == NO_CUDA_EXIT
    text = (layout.session / "kernels.txt").read_text().strip()
    assert text == "kernels: no CUDA device; the check compares compiled kernels"
    assert not list(layout.session.glob("kernels.json*"))
    distances = subprocess.run(
        [
            str(probe_python),
            "-c",
            "import torch\n"
            "from tooling.host.kernel_context import Case, _steps_apart as d\n"
            "bf16 = Case('bf16', 1, 1, 4, 4, True, 'bfloat16', 'auto', 1, 16)\n"
            "fp8 = Case('fp8', 1, 1, 4, 4, True, 'bfloat16', 'fp8', 1, 16)\n"
            "def t(*v): return torch.tensor([v], dtype=torch.bfloat16)\n"
            "def c(*v): return torch.tensor([v], dtype=torch.uint8)\n"
            "row = t(1.0, 0.5, 0.25, 0.002)\n"
            "print(d(bf16, row, t(1.0, 0.5, 0.25, -0.002)))\n"
            "print(d(bf16, row, t(1.0, 0.5, 0.25 + 5 / 128, 0.002)))\n"
            "print(d(bf16, row, t(1.0, 0.5, 0.25 + 6 / 128, 0.002)))\n"
            "print(d(bf16, t(0, 0, 0, 0), t(0, 0, 0, 0)))\n"
            "print(d(fp8, c(0x38, 0x30, 0, 0), c(0x39, 0x30, 0, 0)))\n"
            "print(d(fp8, c(0x38, 0x30, 0, 0), c(0x3A, 0x30, 0, 0)))",
        ],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert distances.returncode == 0, distances.stderr
    # Steps are counted at the row's largest magnitude (1.0: a bfloat16 step is 1/128, an
    # e4m3 step 1/8). A near-zero RoPE output whose sign differs is about half a step there;
    # five steps of bfloat16 are within, six are not; an fp8 cache allows one code more.
    assert distances.stdout.split("\n")[:6] == [
        "(0.51171875, 1, True)",
        "(5.0, 1, True)",
        "(6.0, 1, False)",
        "(0.0, 0, True)",
        "(1.0, 1, True)",
        "(2.0, 1, False)",
    ]


def test_a_background_step_runs_from_a_copy_of_the_checkout_of_its_own(tmp_path):
    """The driver's tool copies the checkout in again with each call: a step started in the
    background imports the toolchain, and reads the series, from a copy no later start writes
    over."""
    from tooling.host.layout import CHECKOUT_PARTS, Layout, detached

    layout = Layout(work=tmp_path / "work")
    log = tmp_path / "child.log"
    code = "import tooling.paths as p; print(p.REPO_DIR); print((p.REPO_DIR / 'patches').is_dir())"
    child = detached(layout, [sys.executable, "-c", code], log=log, env=layout.env())
    assert child.wait(timeout=HANG_GUARD_S) == 0
    where, has_series = log.read_text().split()
    copies = sorted((layout.work / "checkouts").iterdir())
    assert [str(c) for c in copies] == [where] and has_series == "True"
    assert all((copies[0] / part).is_dir() for part in CHECKOUT_PARTS)
    assert not list(copies[0].rglob("__pycache__"))
    again = detached(layout, [sys.executable, "-c", "pass"], log=log, env=layout.env())
    assert again.wait(timeout=HANG_GUARD_S) == 0
    assert len(list((layout.work / "checkouts").iterdir())) == 2


def test_the_referee_rules_with_the_noise_this_hosts_trained_call_measured(tmp_path):
    """The plain engine's own noise between one at a time and at once, from the trained
    call's figures on this host, where it is more than the referee's default: bf16 rounds
    differently on another card. Less, none measured, or figures that are not a run's: the
    default."""
    from tooling.fuzzing.referee import NOISE
    from tooling.host.fuzz import session_noise
    from tooling.host.layout import Layout

    layout = Layout(tmp_path / "work")
    assert session_noise(layout)[0] == NOISE
    layout.runs.mkdir(parents=True)
    figures = layout.runs / "plain.out.json"

    def completion(token: int, second: float) -> dict:
        # The two batch shapes part at position 1: each side's top-2 margin there counts.
        return {
            "tokens": [5, token],
            "logprobs": [{"5": -0.1, "6": -3.0}, {str(token): -1.0, "9": -1.0 - second}],
            "finish_reason": "length",
        }

    def write(ok: bool, second: float) -> None:
        runs = {"1": {"completions": [completion(7, second)]}}
        runs["16"] = {"completions": [completion(8, second)]}
        figures.write_text(json.dumps({"ok": ok, "acceptance": runs}))

    write(True, 0.03125)
    noise, source = session_noise(layout)
    assert noise == 0.0625 > NOISE and str(figures) in source
    write(True, 0.0078125)
    assert session_noise(layout)[0] == NOISE
    write(False, 0.03125)
    assert session_noise(layout)[0] == NOISE
    figures.write_text("[1, 2]")
    assert session_noise(layout)[0] == NOISE
    figures.write_text("not json")
    assert session_noise(layout)[0] == NOISE


def test_the_fuzz_step_settles_its_lossless_findings_with_the_referee(tmp_path, monkeypatch):
    """After a campaign on the trained pair, ``tooling fuzz referee`` (real) runs on its
    lossless findings, into a text of its own: here with an interpreter without torch, its
    one line and exit 32; a campaign with no lossless finding runs no referee."""
    import os

    from tooling.fuzzing.gpu_case import (
        GpuCase,
        GpuCaseFile,
        GpuReq,
        GpuSettings,
        write_gpu_case_file,
    )
    from tooling.fuzzing.gpu_oracles import Evidence
    from tooling.host.fuzz import settle
    from tooling.host.layout import Layout

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    layout = Layout(tmp_path / "work")
    folder, pair = tmp_path / "fuzz-patched-trained", tmp_path / "pair"
    folder.mkdir()
    (pair / "target").mkdir(parents=True)
    (pair / "target" / "config.json").write_text("{}")
    report = tmp_path / "referee.txt"
    assert settle(layout, folder, pair, report, "") is None and not report.exists()
    case = GpuCase(GpuSettings(k=3), (GpuReq(0, 4, 2),))
    evidence = Evidence("r0", (300, 301, 302, 303), (), 9, 8, ((8, -0.25), (9, -0.5)))
    finding = GpuCaseFile(case, "lossless", "r0 position 0", "", (), (evidence,))
    write_gpu_case_file(folder / "finding-lossless-0-0.json", finding)
    # The scheduler side saved beside a finding is no finding: the referee would refuse it.
    (folder / "finding-lossless-0-0.scheduler.json").write_text("{}")
    assert settle(layout, folder, pair, report, "") == 32
    (line,) = report.read_text().strip().splitlines()
    assert "cannot import torch" in line


def test_the_full_width_campaign_runs_each_side_alone_and_is_refused_on_an_h100(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fuzz-seed-full``: the seed's pair at full width in noise mode at this width's plain
    noise, the fixed wheel's campaign alone, one engine pair with small KV caches that draws
    workloads once its 27B-sized engines have started, the day's seed; on a GPU too small for
    two such engines at once it is refused in one line before anything is drawn."""
    import stat
    import time

    from tooling.errors import HostStepError
    from tooling.host.fuzz import NOISY, PAIRS
    from tooling.host.layout import Layout
    from tooling.host.session import (
        FULL_ENGINES,
        FULL_GPU_GIB,
        FULL_KV_GIB,
        FULL_NOISE,
        FULL_PAIR_S,
        full_width_ready,
        fuzz_settings,
    )

    day = time.strptime("2026-12-06", "%Y-%m-%d")
    which, full = fuzz_settings("seed-full", day)
    assert which == "seed-full" and which in PAIRS and which in NOISY
    assert full.noise == FULL_NOISE
    value = {full.args[i]: full.args[i + 1] for i in range(len(full.args) - 1)}
    assert value["--kv-cache-memory-bytes"] == str(FULL_KV_GIB << 30)
    assert value["--settings"] == "1" and value["--seed"] == "20261206"
    assert FULL_ENGINES == ("patched",)
    # Workloads are drawn until the pair's limit less 300 s; the engines' start takes 250.
    assert int(value["--pair-seconds"]) == FULL_PAIR_S and FULL_PAIR_S - 300 >= 250 + 300
    assert STEPS["fuzz-seed-full"].variant == "seed-full"
    # nvidia-smi's answer on a host of one H100 (80 GB).
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho 81559\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tool.parent}:{os.environ['PATH']}")
    out = tmp_path / "out"
    with pytest.raises(HostStepError, match=f"needs a GPU of {FULL_GPU_GIB} GiB or more"):
        full_width_ready(Layout(tmp_path / "work"), out)
    assert not out.exists()


def test_the_host_fuzz_command_needs_the_noise_of_a_random_weight_pair(tmp_path: Path) -> None:
    done = run_gpu_script("gpu-fuzz.sh", "patched", "seed-full", work=tmp_path, out=tmp_path)
    assert done.returncode == 2 and "NOISE" in done.stderr and len(done.stderr.splitlines()) == 1
