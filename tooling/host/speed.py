"""``tooling host speed``: DFlash's speed against plain vLLM on this GPU (``tooling.trained.
speed``), started in a session of its own so that no command of the host's waits on it, then
waited for and its report and figures collected.

- ``draw ARCH DIR [DEVICE]``: a pair with random weights (``tiny``): ``trained-shape`` (the hybrid
  recipe's shapes) or ``seed`` (Qwen3.6-27B's, at full width);
- ``start PAIR [RUN ARGS]``: ``speed run`` on PAIR into ``$WORK/speed`` (engines and levels
  as RUN ARGS say), in the background;
- ``wait SECONDS``: until the run ends or SECONDS pass; its report so far into OUT.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from .. import procs
from ..errors import HostStepError
from .layout import PYTHON, Layout, Modules, run, running, say, since, tail

logger = logging.getLogger(__name__)

#: What ``draw`` can make, with the tiny module's arguments.
ARCHES = {
    "trained-shape": ["--arch", "trained-shape"],
    "seed": ["--arch", "seed", "--hidden-size", "5120"],
}
DEVICES = ("cuda", "cpu")


def _work(layout: Layout) -> Path:
    return layout.work / "speed"


def draw(layout: Layout, arch: str, folder: Path, device: str) -> None:
    """A random-weight pair of ``arch`` in ``folder``, drawn in bf16 on ``device`` (the CPU
    leaves the GPU to a run beside it); made again when its manifest is absent."""
    logger.debug("step: draw the %s pair into %s", arch, folder)
    if (folder / "tiny.json").is_file():
        say(f"{arch} pair: already in {folder}")
        return
    start = time.monotonic()
    cmd = [PYTHON, "-m", Modules.TINY, str(folder), *ARCHES[arch], "--device", device]
    if run(cmd, env=layout.env(str(layout.site))) != 0:
        raise HostStepError(f"the {arch} pair was not drawn into {folder}")
    say(f"{arch} pair: drawn in {since(start)}s into {folder}")


def start(layout: Layout, pair: Path, args: list[str]) -> None:
    """``speed run PAIR $WORK/speed --engines-root $ENGINES ARGS`` in a session of its own."""
    logger.debug("step: start the speed run on %s (%s)", pair, " ".join(args))
    if running(f"{Modules.SPEED} run"):
        raise HostStepError("a speed run is already running")
    work = _work(layout)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "run.log"
    cmd = [PYTHON, "-m", Modules.SPEED, "run", str(pair), str(work)]
    cmd += ["--engines-root", str(layout.engines), *args]
    env = layout.env(str(layout.site), VLLM_LOGGING_LEVEL="WARNING")
    child = procs.start_group(cmd, log=log, env=env, truncate_log=True)
    say(f"speed run started (pid {child.pid}), log {log}")


def wait(layout: Layout, wait_s: int, out: Path) -> int:
    """Wait for the speed run (at most ``wait_s``), then its report (complete or so far), each
    engine's figures and its log's end into ``out``; 1 while it still runs."""
    logger.debug("step: wait for the speed run (at most %ds)", wait_s)
    limit = wait_s
    while running(f"{Modules.SPEED} run") and limit > 0:
        time.sleep(5)
        limit -= 5
    work = _work(layout)
    out.mkdir(parents=True, exist_ok=True)
    report = out / "speed-report.md"
    with open(report, "wb") as text:
        run([PYTHON, "-m", Modules.SPEED, "report", str(work)], env=layout.env(), stdout=text)
    for found in [*work.glob("*.out.json"), *work.glob("*.partial.json"), *work.glob("*.log")]:
        shutil.copy2(found, out / found.name)
    for line in tail(work / "run.log", 15):
        say(line)
    still = running(f"{Modules.SPEED} run")
    say(f"speed run: {'running' if still else 'ended'}")
    return 1 if still else 0
