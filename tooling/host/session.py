"""``hybrid-session.sh``: one GPU session's work on the seed's family, in the background (it
outlasts any one command): ``start`` installs and starts it, ``background`` is the session
itself running its steps one after another, ``collect`` and ``wait`` bring back what it has
written so far."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import pidfile
from ..errors import HostRefusal, HostStepError, HostUsageError, VerifyFixMissingError
from ..paths import REPO_DIR
from ..trained.gpu_fit import gpu_memory_gib
from .fuzz import ENGINES as FUZZ_ENGINES
from .fuzz import FuzzSettings, full_width_pair, fuzz
from .layout import PYTHON, Layout, Modules, run, running, say, shown, since, tail, written
from .layout import detached as in_background
from .proof import seed_pair
from .setup import SetupStep, setup
from .speed import drawn_arch, seed_args, speed_args, wide_gpu
from .steps import STEPS, Kind, Step, session_ablations
from .trained import RECIPE, TrainSettings, provide_pair

logger = logging.getLogger(__name__)


#: The fuzz step's campaigns, beside the training: engine pairs one after another, none
#: started after FUZZ_S, each drawing workloads until FUZZ_PAIR_S less 300 s from its start
#: (its engines' start included) and stopped at FUZZ_PAIR_S, so that about two pairs fit
#: the recipe's training. Differences kept as drawn (a shrink is GPU time the
#: steps after it need). A setting the DFlash engine refuses ends its pair at once, so the
#: campaign draws several. On the seed-shaped pair, whose logprobs differ by up to
#: FUZZ_NOISE between two plain runs (2026-12-01 GPU smoke, check 10).
FUZZ_S = 360
FUZZ_PAIR_S = 600
FUZZ_NOISE = "0.1251"
FUZZ_ARGS = ("--settings", "8", "--pair-seconds", str(FUZZ_PAIR_S), "--no-shrink")
#: ``fuzz-seed-full``: the seed's pair at full width, the fixed wheel's campaign alone: stock's
#: fails on the smaller pairs already, and two campaigns of 27B-sized engines, one after the
#: other, do not fit one session's device time. One engine pair. A KV cache of FULL_KV_GIB
#: holds two requests at K = 15 (1.51 GiB each at this width), so a workload's other requests
#: wait for blocks, as a full server's do. Its logprobs differ by up to FULL_NOISE between two
#: plain runs (2026-12-02, check 10 at this width).
FULL_ENGINES = ("patched",)
FULL_S = 60
FULL_KV_GIB = 4
FULL_NOISE = "0.3120"
FULL_ARGS = (
    *("--settings", "1", "--no-shrink"),
    *("--kv-cache-memory-bytes", str(FULL_KV_GIB << 30)),
)
#: Where both engines of the pair fit the GPU at once (``speed.wide_gpu``), the pair is
#: stopped at FULL_PAIR_S; its engines' start (compile and capture) takes about 250 s of it,
#: and it draws workloads until FULL_PAIR_S less 300 s.
FULL_PAIR_S = 900
#: Where one engine fits alone, the DFlash engine serves first and the plain engine then the
#: same workloads, each stopped at FULL_ONE_PAIR_S. The DFlash engine draws workloads until
#: FULL_ONE_PAIR_S less 300 s, about 200 s of them after its start, so that both engines fit
#: one session's device time.
FULL_ONE_PAIR_S = 750
#: What fits one session with the recipe's training beside the smokes.
DEFAULT_STEPS = ("seed", "seed-stock", "trained")


def generated_weights(folder: Path) -> list[Path]:
    """The weights of the pairs a step generated (under a ``models/`` folder of its own):
    they go once it has ended; its manifests, configs and reports stay."""
    found = []
    for path in folder.rglob("*.safetensors"):
        if "models" in path.relative_to(folder).parts[:-1]:
            found.append(path)
    return found


def mark(line: str) -> None:
    say(f"[{time.strftime('%H:%M:%S')}] {line}")


def check_steps(steps: list[str]) -> None:
    if any(STEPS[s].kind is Kind.TRAINED for s in steps) and any(
        s.startswith("seed-full") for s in steps
    ):
        raise HostUsageError(
            "seed-full's 57 GB leave no disk for trained's installs: one per session"
        )


def start(
    parts: Path, steps: list[str], layout: Layout, pair_parts: Path | None, trainer: TrainSettings
) -> None:
    """Install the bundle, start the recipe (or carry the pair in) when a step needs the
    pair, then the session in the background."""
    logger.debug("step: start a session of %s", " ".join(steps))
    check_steps(steps)
    record = layout.session / "background.pid"
    # A second start would reinstall the site the running session imports from.
    with contextlib.suppress(pidfile.NoRecord):
        if record.is_file() and (pid := pidfile.running(record)) is not None:
            raise HostRefusal(
                f"{layout.session}: a session is already running (pid {pid}): wait for it"
            )
    layout.session.mkdir(parents=True, exist_ok=True)
    # The host's packages with their versions, which its image's list lacks: a bundle made
    # with them as --exclude-present carries only what differs (0.34.0's, issue 48).
    with written(layout.session / "host-freeze.txt") as freeze:
        run([PYTHON, "-m", "pip", "freeze", "--all"], env=layout.env(), stdout=freeze, limit_s=60)
    setup(parts, SetupStep.INSTALL, layout, [], None)
    if any(STEPS[s].kind in (Kind.PAIR, Kind.TRAINED, Kind.SPEED) for s in steps):
        provide_pair(layout, pair_parts, trainer)
    # Without OUT: the folder a command brings back, which a step writing there from
    # the background would fill with files that command was not run for.
    env = {k: v for k, v in layout.env().items() if k != "OUT"}
    cmd = [PYTHON, "-m", Modules.TOOLING, "host", "session", "--", "background", str(parts)]
    log = layout.session / "session.log"
    child = in_background(layout, [*cmd, *steps], log=log, env=env)
    pidfile.record(record, child.pid)
    say(f"session started (pid {child.pid}): {' '.join(steps)}; log {log}")


def _smoke(step: Step, out: Path, text: Path, env: dict[str, str]) -> int:
    """``tooling host smoke`` of the step's variant into ``out``, its lines into ``text``."""
    env = {**env, "OUT": str(out)}
    if step.smoke_args:
        env["SMOKE_ARGS"] = step.smoke_args
    cmd = [PYTHON, "-m", Modules.TOOLING, "host", "smoke", "--", step.variant]
    with written(text) as log:
        return run(cmd, env=env, stdout=log, stderr=log)


def _drawn(layout: Layout, step: Step, env: dict[str, str]) -> int:
    """The 5120-wide pair drawn on the GPU, then smoked as a user's pair; with --quick,
    then bench/bench_reference.py on it: where the reference comparison's time goes."""
    session, pair = layout.session, layout.session / "seed-5120"
    site = f"{env['PATCHED_SITE']}:{REPO_DIR}"
    began = time.monotonic()
    draw = [PYTHON, "-m", Modules.TINY, str(pair), "--arch", "seed", "--hidden-size", "5120"]
    with written(session / "draw.txt") as log:
        code = run(
            [*draw, "--device", "cuda"], env={**env, "PYTHONPATH": site}, stdout=log, stderr=log
        )
    mark(f"the pair drawn on the GPU: exit {code} in {since(began)}s")
    if code != 0:
        return code
    out, text = session / step.name, session / f"{step.name}.txt"
    code = _smoke(step, out, text, {**env, "PAIR": str(pair)})
    if not step.smoke_args:
        return code
    mark(f"the pair's quick smoke: exit {code}")
    bench = [PYTHON, str(REPO_DIR / "bench" / "bench_reference.py")]
    bench += ["--target", str(pair / "target"), "--drafter", str(pair / "drafter")]
    bench += ["--engine-result", str(out / "pair" / "engine.json")]
    bench += ["--json", str(session / "bench-reference.json")]
    with written(session / "bench-reference.txt") as log:
        return run(bench, env={**env, "PYTHONPATH": site}, stdout=log, stderr=log, limit_s=480)


def _trained(layout: Layout, step: Step, env: dict[str, str]) -> int:
    """The recipe waited for (``pair``; ``speed`` first too), then the step's calls or its
    speed run, into ``$SESSION/STEP.txt``."""
    command = "chain" if step.kind is Kind.TRAINED else "wait"
    env = {"WAIT_S": "1500", **env}
    if step.calls:
        env["CALLS"] = step.calls
    if step.engines:
        env["ENGINES"] = step.engines
    cmd = [PYTHON, "-m", Modules.TOOLING, "host", "trained", "--", command]
    with written(layout.session / f"{step.name}.txt") as log:
        code = run(cmd, env=env, stdout=log, stderr=log)
        if code != 0 or step.kind is not Kind.SPEED:
            return code
        speed = [PYTHON, "-m", Modules.TOOLING, "host", "speed", "run", str(layout.pair)]
        args = speed_args(step.variant)
        return run([*speed, *args], env=env, stdout=log, stderr=log)


def _speed_shape(layout: Layout, step: Step, env: dict[str, str]) -> int:
    """The recipe's shapes, or the seed's (``speed-seed``), drawn with random weights on the
    GPU (under the step's ``models/``, deleted once it ends), then the speed run on them, into
    ``$SESSION/STEP.txt``."""
    arch = drawn_arch(step.variant)
    pair = layout.session / step.name / "models" / arch
    host = [PYTHON, "-m", Modules.TOOLING, "host", "speed"]
    try:
        variant = step.variant or "shape"
        args = seed_args(gpu_memory_gib()) if variant == "seed" else speed_args(variant)
    except HostStepError as e:
        mark(f"{step.name}: {e}")
        return 1
    with written(layout.session / f"{step.name}.txt") as log:
        draw = [*host, "draw", arch, str(pair), "cuda"]
        code = run(draw, env=env, stdout=log, stderr=log)
        if code != 0:
            return code
        speed = [*host, "run", str(pair), *args]
        return run(speed, env=env, stdout=log, stderr=log)


def verify_failure(engine: str, done: int) -> int:
    """What ``tooling verify``'s exit ``done`` on ``engine`` makes of the step: 0 where it is
    a verdict the install should give. Stock lacks the fixes (exit 15 is its verdict); the
    fixed wheel lacking one is the step's failure, with verify's own exit."""
    verdicts = (0, VerifyFixMissingError.exit_code) if engine == "stock" else (0,)
    return 0 if done in verdicts else done


def _verify(layout: Layout, step: Step, env: dict[str, str]) -> int:
    """Each install's verdicts into ``$SESSION/STEP-ENGINE.txt``, the fixed wheel's first
    (a session cut short keeps the verdicts that matter); the first failure's exit, else 0."""
    code = 0
    # verify takes the probes' interpreter as a path.
    probe = shutil.which(PYTHON, path=env.get("PATH")) or PYTHON
    for engine in ("patched", "stock"):
        cmd = [PYTHON, "-m", Modules.TOOLING, "verify"]
        cmd += ["--site-packages", str(layout.engine(engine)), "--probe-python", probe]
        with written(layout.session / f"{step.name}-{engine}.txt") as log:
            done = run(cmd, env={**env, "PYTHONPATH": str(layout.site)}, stdout=log, stderr=log)
        mark(f"verify {engine}: exit {done}")
        code = code or verify_failure(engine, done)
    return code


def _kernel(layout: Layout, step: Step, env: dict[str, str]) -> int:
    """The kernel checks in the fixed engine's interpreter: the report in
    ``$SESSION/STEP.json``, its lines in ``STEP.txt``; 0 when every case agrees."""
    cmd = [PYTHON, "-m", "tooling.host.kernels", "--out", str(layout.session / f"{step.name}.json")]
    site = f"{env['PATCHED_SITE']}:{REPO_DIR}"
    with written(layout.session / f"{step.name}.txt") as log:
        return run(cmd, env={**env, "PYTHONPATH": site}, stdout=log, stderr=log)


def fuzz_args(day: time.struct_time, args: tuple[str, ...] = FUZZ_ARGS) -> tuple[str, ...]:
    """A fuzz step's options: ``args`` and the campaign's seed, the day's date, so that
    each day's sessions draw other settings than the last day's, and a campaign's report
    names the seed that draws it again."""
    return (*args, "--seed", time.strftime("%Y%m%d", day))


#: The GPU cases the fuzzer found and kept, each served again by ``fuzz-replay`` (on the
#: seed-shaped pair, where they were found).
GPU_CASES = REPO_DIR / "tests" / "data" / "gpu-fuzz"


def fuzz_settings(
    variant: str,
    day: time.struct_time,
    reference: float | None = None,
    cases: tuple[Path, ...] = (),
    gpu_gib: float | None = None,
) -> tuple[str, FuzzSettings]:
    """The pair a fuzz step's campaigns run on and their settings: drawn from the day's seed
    (``seed``: noise mode; ``seed-full``: the same at full width, on a GPU of ``gpu_gib``;
    ``trained``: lossless, the acceptance oracle against the recipe's ``reference`` when
    known), or the kept ``cases`` replayed (``replay``)."""
    if variant == "seed":
        return "seed", FuzzSettings(FUZZ_S, FUZZ_NOISE, fuzz_args(day))
    if variant == "seed-full":
        more = (*FULL_ARGS, *full_width_pairing(gpu_gib))
        return "seed-full", FuzzSettings(FULL_S, FULL_NOISE, fuzz_args(day, more))
    if variant == "trained":
        more = ("--reference-acceptance", f"{reference:.3f}") if reference else ()
        return "trained", FuzzSettings(FUZZ_S, None, (*fuzz_args(day), *more))
    if not cases:
        raise HostStepError(f"no kept GPU case in {GPU_CASES}")
    replays = tuple(a for case in cases for a in ("--replay", str(case)))
    return "seed", FuzzSettings(FUZZ_S, FUZZ_NOISE, ("--pair-seconds", str(FUZZ_PAIR_S), *replays))


def _reference(layout: Layout) -> float | None:
    """The recipe's reference acceptance (the dflash package on the held-out prompts)."""
    try:
        summary = json.loads((layout.work / "train-out" / "summary.json").read_text())
        return float(summary["mean_acceptance_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _fuzz(layout: Layout, step: Step, out: Path, env: dict[str, str]) -> int:
    """The fixed wheel's campaign and stock's at once, on the same settings; the worse exit
    status (25: something found). ``trained`` waits for the recipe's pair first."""
    out.mkdir(parents=True, exist_ok=True)
    if step.variant == "trained":
        wait = [PYTHON, "-m", Modules.TOOLING, "host", "trained", "--", "wait"]
        with written(layout.session / f"{step.name}-wait.txt") as log:
            if run(wait, env={"WAIT_S": "1500", **env}, stdout=log, stderr=log) != 0:
                mark(f"fuzz: no trained pair ({layout.session / f'{step.name}-wait.txt'})")
                return 1
    try:
        cases = tuple(sorted(GPU_CASES.glob("*.json")))
        gib = gpu_memory_gib() if step.variant == "seed-full" else None
        which, settings = fuzz_settings(step.variant, time.gmtime(), _reference(layout), cases, gib)
        mark(f"fuzz: {which} pair, {' '.join(settings.args)}")
        # The seed-shaped pair is written once, before the two campaigns would race to it.
        pair = layout.work / "seed-pair"
        if which == "seed" and not (pair / "tiny.json").is_file():
            seed_pair(layout, out, pair)
    except (HostStepError, OSError) as e:
        mark(f"fuzz: {e}")
        return 1

    def one(engine: str) -> int:
        try:
            return fuzz(engine, which, layout, out, settings)
        except (HostStepError, OSError) as e:
            mark(f"fuzz {engine}: {e}")
            return 1

    if which == "seed-full":
        try:
            full_width_pair(layout, out)
        except (HostStepError, OSError) as e:
            mark(f"fuzz: {e}")
            return 1
        return max(one(engine) for engine in FULL_ENGINES)
    with ThreadPoolExecutor(max_workers=len(FUZZ_ENGINES)) as pool:
        return max(pool.map(one, FUZZ_ENGINES))


def full_width_pairing(gib: float | None) -> tuple[str, ...]:
    """How the full-width pair's engines share a GPU of ``gib``: at once where both fit,
    one after the other where one fits (``speed.wide_gpu``, which refuses a smaller one)."""
    if wide_gpu(gib, "the seed's pair at full width"):
        return ("--pair-seconds", str(FULL_PAIR_S))
    return ("--pair-seconds", str(FULL_ONE_PAIR_S), "--one-engine-at-a-time")


def background(parts: Path, steps: list[str], layout: Layout) -> int:
    """The session itself: the engines' installs, then each step; a step's status is in
    its mark, and its generated weights go once it has ended (the next step needs the
    disk)."""
    logger.debug("step: the session, %s", " ".join(steps))
    session = layout.session
    ablated = session_ablations(steps)
    mark("building the engines' installs")
    env = layout.env(None, PROBES="0", ABLATIONS=" ".join(ablated))
    build = [PYTHON, "-m", Modules.TOOLING, "host", "setup", "--", str(parts), "build"]
    with written(session / "build.log") as log:
        if run(build, env=env, stdout=log, stderr=log) != 0:
            mark(f"build failed: {session / 'build.log'}")
            return 1
    sites = {
        "PATCHED_SITE": f"{layout.engine('patched')}:{layout.site}",
        "STOCK_SITE": str(layout.engine("stock")),
    }
    for name in steps:
        step = STEPS[name]
        # Beside the recipe's training the GPU holds its processes too; alone, each smoke
        # lists any vLLM or Ray process it left behind. `pair` only waits for the training,
        # and `speed` measures once it has ended.
        shared = step.kind not in (Kind.PAIR, Kind.SPEED) and running(RECIPE)
        env = {k: v for k, v in layout.env(None, **sites).items() if k != "SHARED_GPU"}
        if shared:
            env["SHARED_GPU"] = "1"
        mark(f"{name}{' (beside the training)' if shared else ''}")
        if step.kind is Kind.SMOKE:
            code = _smoke(step, session / name, session / f"{name}.txt", env)
        elif step.kind is Kind.DRAWN:
            code = _drawn(layout, step, env)
        elif step.kind is Kind.FUZZ:
            code = _fuzz(layout, step, session / name, env)
        elif step.kind is Kind.SPEED_SHAPE:
            code = _speed_shape(layout, step, env)
        elif step.kind is Kind.VERIFY:
            code = _verify(layout, step, env)
        elif step.kind is Kind.KERNEL:
            code = _kernel(layout, step, env)
        else:
            code = _trained(layout, step, env)
        mark(f"{name}: exit {code}")
        for weights in generated_weights(session / name):
            weights.unlink()
    return 0


def _pack(
    layout: Layout, archive: Path, roots: tuple[str, ...], suffixes: tuple[str, ...], mib: int
) -> None:
    """Into ``archive``, the files under ``roots`` (in ``$WORK``) ending in ``suffixes``,
    of at most ``mib`` MiB, never a compile cache's."""
    names = []
    for root in roots:
        for folder, _, files in os.walk(layout.work / root):
            for name in files:
                path = Path(folder) / name
                if (
                    path.suffix in suffixes
                    and "vllm-cache" not in str(path.relative_to(layout.work))
                    and path.stat().st_size <= mib << 20
                ):
                    names.append(path.relative_to(layout.work))
    with tarfile.open(archive, "w:gz") as tar:
        for relative in sorted(names):
            tar.add(layout.work / relative, arcname=str(relative), recursive=False)


def collect(layout: Layout, out: Path) -> None:
    """Where the session stands, and every step's text in one file, the reports and the
    processes' logs packed apart (if the logs are too many to bring back, only they are
    left out); never the models or the compile caches."""
    logger.debug("step: collect the session into %s", out)
    session = layout.session
    for line in _lines(session / "session.log"):
        say(line)
    for line in tail(layout.work / "train-hybrid.log", 3, skip="[transformers]"):
        say(line)
    texts = [
        *sorted(session.glob("*.txt")),
        *sorted((layout.work / "results").glob("trained-report-*.txt")),
    ]
    with open(out / "texts.txt", "w", encoding="utf-8") as joined:
        for text in texts:
            body = text.read_text(errors="replace").rstrip("\n")
            joined.write(f"== {text.relative_to(layout.work)}\n{body}\n\n")
    _pack(
        layout,
        out / "reports.tgz",
        ("session", "results", "train-out", "trained", "speed"),
        (".json", ".txt", ".md"),
        3,
    )
    _pack(layout, out / "logs.tgz", ("session", "trained", "speed"), (".log", ".err"), 7)
    say(shown(["ls", "-la", str(out)], env=layout.env()))


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def wait(layout: Layout, seconds: int, out: Path) -> None:
    """Wait for the session to end, at most ``seconds``; collect, then say where it stands
    and the running smoke's last progress lines."""
    logger.debug("step: wait for the session (at most %ds)", seconds)
    record = layout.session / "background.pid"
    if not record.is_file():
        raise HostUsageError(f"{record}: no session was started here")
    summary = layout.pair / "summary.json"
    paired = summary.is_file()
    try:
        pidfile.running(record)
        end = time.monotonic() + seconds
        while pidfile.running(record) is not None and time.monotonic() < end:
            # The pair's export is calls of their own, best made while the session's steps
            # run: a wait that sees the pair written returns for them.
            if not paired and summary.is_file():
                break
            time.sleep(2)
        state = "ended" if pidfile.running(record) is None else "running"
    except pidfile.NoRecord as e:
        raise HostRefusal(str(e)) from None
    with open(out / "collect.txt", "w", encoding="utf-8") as text, contextlib.redirect_stdout(text):
        collect(layout, out)
    for line in _lines(layout.session / "session.log"):
        say(line)
    errs = sorted(layout.session.glob("*/*.err"), key=lambda p: p.stat().st_mtime)
    if errs:
        for line in [x for x in _lines(errs[-1]) if x.startswith("[smoke]")][-8:]:
            say(line)
    if summary.is_file() and not (layout.work / "pair-parts").is_dir():
        say("pair: written and not exported; `trained-hybrid.sh export-pair 0`, 1, ... now")
    say(f"session: {state}")
