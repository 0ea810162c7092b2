"""``serving.watch.Joins`` on vLLM's real Scheduler (the fixed tree, on the CPU): the
prompts a step admits, which the speed run files each sustained step under."""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

from tooling.paths import REPO_DIR

SCRIPT = textwrap.dedent(
    """
    import tempfile
    from pathlib import Path

    from tooling.probes._schedsim import Req, Settings, build_engine, engine_request
    from tooling.probes._schedsim import h200_platform
    from tooling.trained.serving.watch import Joins

    with tempfile.TemporaryDirectory() as tmp, h200_platform():
        engine = build_engine(Settings(k=15, max_num_seqs=64, max_model_len=2048), Path(tmp))
        joins = Joins()
        joins.install()
        for i in range(2):
            req = Req(arrival=0, prompt_len=256, max_tokens=8)
            engine.scheduler.add_request(engine_request(i, req, engine.hasher))
        engine.scheduler.schedule()
        first = joins.take()
        engine.scheduler.schedule()
        print("joined", first, joins.take())
    """
)


@pytest.mark.slow
def test_joins_counts_the_prompts_the_scheduler_admits(patched_0201, probe_python):
    env = {**os.environ, "PYTHONPATH": f"{patched_0201.work_dir}{os.pathsep}{REPO_DIR}"}
    done = subprocess.run(
        [str(probe_python), "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # Both prompts join the first step; the second step admits none.
    assert "joined 2 0" in done.stdout.splitlines()
