"""The reference comparison from the toolchain's side: shards started early, work handed over late.

The comparison (``serving.reference``) spends most of its time in one drafter pass
per proposal, a few hundred small kernel launches each: it is bound by one Python
thread, not by the GPU. So the runner splits the prompts over several children on
one GPU where it holds that many copies of the pair, and, where the plan places them
beside the engines (``plan.Step.loads_before_the_engine``), starts them with the
engines: each loads the pair, then waits on stdin for the path of its share of the
work (``dispatch``, as soon as the in-process engine has run), and the first one for the
servers' divergences too (``finish``, once the servers are observed). Each child writes counts
(``serving.agreement.Tally``); their sum is the result one process would give.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SmokeError
from ..procs import log_tail, start_group, stop_group
from .serving.agreement import Tally, shard_prompts

logger = logging.getLogger(__name__)

MODULE = "tooling.smoke.serving.reference"


@dataclass
class ReferencePool:
    """``shards`` reference children of one comparison, named ``name`` in files and logs."""

    python: str
    workdir: Path
    logs: Path
    name: str
    setup: dict[str, Any]
    """serving.reference.ModelSetup's fields: the models each child loads."""
    shards: int
    env: Mapping[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    dispatched: bool = False
    """Whether the shards have their work (``dispatch``)."""

    def log(self, i: int) -> Path:
        """Shard i's log."""
        return self.logs / f"{self.name}-reference-{i}.log"

    def _out(self, i: int) -> Path:
        return self.workdir / f"{self.name}-fidelity-{i}.json"

    def start(self) -> None:
        """Start the children (once): each loads the models, then waits for work."""
        if self.procs:
            return
        setup = self.workdir / f"{self.name}-reference-setup.json"
        setup.write_text(json.dumps(self.setup, indent=1), encoding="utf-8")
        for i in range(self.shards):
            self._out(i).unlink(missing_ok=True)
            self.log(i).unlink(missing_ok=True)
            self.procs.append(
                start_group(
                    [self.python, "-m", MODULE, str(setup), str(self._out(i))],
                    log=self.log(i),
                    env=self.env,
                    stdin=subprocess.PIPE,
                )
            )

    def stop(self) -> None:
        """Stop every child; one still waiting for work sees its stdin close first."""
        for proc in self.procs:
            if proc.stdin:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        for proc in self.procs:
            stop_group(proc, grace_s=5.0)

    def dispatch(self, request: dict[str, Any]) -> None:
        """Hand each shard its share of ``request``'s proposals now (its divergences aside:
        ``finish`` sends them), so the shards compare while the servers are observed."""
        self.start()
        counts: dict[int, int] = {}
        for proposal in request["proposals"]:
            counts[int(proposal["prompt"])] = counts.get(int(proposal["prompt"]), 0) + 1
        plan = shard_prompts(counts, self.shards)
        logger.debug(
            "%s reference: %d proposals to %d shards",
            self.name,
            sum(counts.values()),
            len(self.procs),
        )
        for i, proc in enumerate(self.procs):
            share = plan[i] if i < len(plan) else []
            work = {**request, "prompt_indices": share, "divergences": []}
            path = self.workdir / f"{self.name}-reference-in-{i}.json"
            path.write_text(json.dumps(work), encoding="utf-8")
            assert proc.stdin is not None
            # A child that already failed has closed its end; its result file says why.
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(f"{path}\n".encode())
                proc.stdin.flush()
                # The first shard waits for the divergences; the others have all their work.
                if i > 0:
                    proc.stdin.close()
        self.dispatched = True

    def finish(self, divergences: list[dict[str, Any]], timeout_s: float) -> dict[str, Any]:
        """Send the first shard the servers' divergences (one target pass each), wait for
        every shard, and add up their counts: the fidelity result of the dispatched work;
        SmokeError naming the shard's log when one fails or runs out of time."""
        first = self.procs[0]
        assert first.stdin is not None
        with contextlib.suppress(BrokenPipeError, ValueError):
            if divergences:
                path = self.workdir / f"{self.name}-divergences.json"
                path.write_text(json.dumps(divergences), encoding="utf-8")
                first.stdin.write(f"{path}\n".encode())
            first.stdin.close()
        deadline = time.monotonic() + timeout_s
        tallies = []
        for i, proc in enumerate(self.procs):
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                raise SmokeError(
                    f"{MODULE} did not finish within {timeout_s:.0f}s (log: {self.log(i)})"
                ) from None
            tallies.append(Tally.from_json(self._result(i)["tally"]))
        result = Tally.merged(tallies).result()
        result["shards"] = len(tallies)
        return result

    def _result(self, i: int) -> dict[str, Any]:
        out, log = self._out(i), self.log(i)
        try:
            data: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise SmokeError(f"{MODULE} wrote no result: {log_tail(log)} (log: {log})") from None
        if not data.get("ok"):
            raise SmokeError(f"{data.get('error')} (log: {log})")
        return data


@contextlib.contextmanager
def reference_pool(
    python: str,
    workdir: Path,
    logs: Path,
    name: str,
    setup: dict[str, Any],
    *,
    shards: int,
    env: Mapping[str, str],
    early: bool,
) -> Iterator[ReferencePool]:
    """A pool started now (``early``) or at its first comparison; stopped on any way out."""
    pool = ReferencePool(python, workdir, logs, name, setup, shards, env)
    try:
        if early:
            pool.start()
        yield pool
    finally:
        pool.stop()
