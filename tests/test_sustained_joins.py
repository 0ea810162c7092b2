"""``serving.watch.Joins`` on vLLM's real Scheduler (the fixed tree, on the CPU): the
prompts a step admits, which the speed run files each sustained step under."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from .helpers import run_on_tree

SCRIPT = textwrap.dedent(
    """
    import json
    import sys
    import tempfile
    from pathlib import Path

    from tooling.probes._schedsim import Req, Settings, build_engine, engine_request
    from tooling.probes._schedsim import h200_platform
    from tooling.trained.serving.watch import Joins

    with tempfile.TemporaryDirectory() as tmp, h200_platform():
        engine = build_engine(Settings(k=15, max_num_seqs=64, max_model_len=2048), Path(tmp))
        joins = Joins()
        joins.install()
        for i in range(int(sys.argv[1])):
            req = Req(arrival=0, prompt_len=256, max_tokens=8)
            engine.scheduler.add_request(engine_request(i, req, engine.hasher))
        taken = []
        for _ in range(2):
            engine.scheduler.schedule()
            taken.append(joins.take())
    Path(sys.argv[2]).write_text(json.dumps({"joined": taken}))
    """
)


@pytest.mark.slow
def test_joins_counts_the_prompts_the_scheduler_admits(patched_0201, probe_python, tmp_path):
    out = run_on_tree(probe_python, Path(patched_0201.work_dir), tmp_path, SCRIPT, "2", timeout=600)
    # Both prompts join the first step; the second step admits none.
    assert out["joined"] == [2, 0]
