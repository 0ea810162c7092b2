"""``tooling host``'s steps as they run on a GPU host: the pair carried in, children started
and shown, reports kept and weights let go, so a session's steps work before it spends the GPU's
time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tooling.host.session import STEPS
from tooling.paths import REPO_DIR
from tooling.release.split import split_bundle

from .helpers import HANG_GUARD_S, run_gpu_script


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


def test_the_speed_wait_brings_back_each_run_a_session_made_on_one_pair(tmp_path: Path) -> None:
    """A run set aside by a later one in the same folder comes back too, each with its
    report, in the archive's folder of its own."""
    import tarfile

    from tooling.host.layout import Layout
    from tooling.host.speed import ARCHIVE, wait

    layout = Layout(tmp_path / "work")
    work = layout.work / "speed" / "hybrid-pair"
    (work / "earlier-1").mkdir(parents=True)
    for folder, engine in ((work / "earlier-1", "dflash-hold"), (work, "dflash-no-drafter-graphs")):
        (folder / "engines.json").write_text("[]")
        (folder / f"{engine}.out.json").write_text("{}")
    out = tmp_path / "out"
    # The host's own runs are any on the machine; here, beside other tests' draws, none.
    assert wait(layout, 0, out, busy=lambda: False) == 0
    with tarfile.open(out / ARCHIVE) as archive:
        names = set(archive.getnames())
    assert "hybrid-pair/earlier-1/dflash-hold.out.json" in names
    assert "hybrid-pair/dflash-no-drafter-graphs.out.json" in names
    assert (out / "hybrid-pair-report.md").is_file()
    assert (out / "hybrid-pair-earlier-1-report.md").is_file()


def test_the_verify_step_runs_tooling_verify_on_each_install_and_keeps_its_lines(
    tmp_path: Path,
) -> None:
    """``verify`` runs the real ``tooling verify`` on the patched and the stock install, each
    into a text of its own; an install with no vLLM is an error, not a verdict, and the
    step's exit names it."""
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


def test_a_fix_missing_from_the_fixed_wheel_fails_the_verify_step_and_stocks_is_a_verdict():
    from tooling.errors import VerifyFixMissingError
    from tooling.host.session import verify_failure

    missing = VerifyFixMissingError.exit_code
    assert verify_failure("stock", missing) == 0
    assert verify_failure("stock", 0) == 0
    assert verify_failure("patched", 0) == 0
    assert verify_failure("patched", missing) == missing
    assert verify_failure("stock", 16) == 16


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
