"""``hybrid-proof.sh CALL``: the hybrid defects' proof on one GPU host (tooling/smoke/
distribution.py says what it compares): the seed-shaped pair, each engine variant of one call
in its own process, all at once on one GPU, each with its own compile cache."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from ..errors import HostStepError
from .layout import (
    PYTHON,
    Child,
    Layout,
    Modules,
    run,
    run_together,
    say,
    shown,
    since,
    tail,
    written,
)

#: The calls: 1 the plain engine and the K=15 pair; 2 the K=3 pair and the K=15 engine
#: without the GDN gate patch; 3 PIECEWISE graphs under 64 concurrent requests.
CALLS = ("1", "2", "3")

logger = logging.getLogger(__name__)


def engine_line(result: Path) -> str:
    """One engine's start, from its result: how long, which graphs, how many blocks."""
    try:
        r = json.loads(result.read_text())
    except (OSError, ValueError) as e:
        return f"{result.name}: unreadable ({e})"
    if r.get("ok"):
        return (
            f"{result.name}: started in {r['startup_s']:.0f}s, {r['cudagraph_mode']}, "
            f"{r['num_gpu_blocks']} blocks, capture sizes {r['capture_sizes'][:6]}..."
        )
    return f"{result.name}: {r.get('error')}"


#: The seed-shaped pair's shape: Qwen3.6-27B's layers and heads at hidden size 512.
SEED_SHAPE = ("--arch", "seed", "--hidden-size", "512")


def seed_pair(
    layout: Layout,
    proof: Path,
    pair: Path,
    shape: tuple[str, ...] | list[str] = SEED_SHAPE,
    device: str | None = None,
) -> None:
    """The seed-shaped pair (random weights, ``shape``, drawn on ``device``, the tiny
    module's default where None) written into ``pair``; its log in ``proof``."""
    start = time.monotonic()
    cmd = [PYTHON, "-m", Modules.TINY, str(pair), *shape]
    if device is not None:
        cmd += ["--device", device]
    with written(proof / "pair.log") as log:
        code = run(cmd, env=layout.env(str(layout.site)), stdout=log, stderr=log)
    if code != 0:
        for line in tail(proof / "pair.log", 20):
            say(line)
        raise HostStepError(f"the seed-shaped pair was not written (exit {code})")
    size = shown(["du", "-sh", str(pair)], env=layout.env()).split("\t")[0]
    say(f"seed-shaped pair written in {since(start)}s: {size}")


def proof(call: str, layout: Layout, out: Path, time_limit: int) -> int:
    """One call's engines, then the report of every call so far into ``out``; its exit
    status is the report's."""
    logger.debug("step: hybrid proof call %s", call)
    proof_dir, pair = layout.work / "proof", layout.work / "seed-pair"
    proof_dir.mkdir(parents=True, exist_ok=True)
    if not (pair / "tiny.json").is_file():
        seed_pair(layout, proof_dir, pair)
    site = layout.env(str(layout.site))
    plan = [PYTHON, "-m", Modules.PROOF, "plan", str(proof_dir)]
    plan += ["--target", str(pair / "target"), "--drafter", str(pair / "drafter")]
    with written(proof_dir / "variants.txt") as listing:
        if run(plan, env=site, stdout=listing) != 0:
            raise HostStepError("the proof's variants could not be planned")
    children = []
    for line in (proof_dir / "variants.txt").read_text().splitlines():
        name, engine, variant_call = line.split(maxsplit=2)
        if variant_call != call:
            continue
        files = [str(proof_dir / f"{name}.in.json"), str(proof_dir / f"{name}.out.json")]
        env = layout.env(
            f"{layout.engine(engine)}:{layout.site}",
            VLLM_CACHE_ROOT=str(layout.work / f"vllm-cache-{name}"),
        )
        cmd = (PYTHON, "-m", Modules.PROOF_ENGINE, *files)
        children.append(Child(cmd, env, proof_dir / f"{name}.log", None, time_limit, 15))
    start = time.monotonic()
    run_together(children)
    say(f"call {call}: engines done in {since(start)}s")
    for result in sorted(proof_dir.glob("*.out.json")):
        say(engine_line(result))
    report = out / f"report-{call}.txt"
    with written(report) as text:
        code = run(
            [PYTHON, "-m", Modules.PROOF, "report", str(proof_dir), "--through-call", call],
            env=site,
            stdout=text,
        )
    say(report.read_text(errors="replace").rstrip("\n"))
    run(
        ["tar", "-czf", str(out / f"proof-{call}.tar.gz"), "-C", str(layout.work), "proof"],
        env=layout.env(),
    )
    return code
