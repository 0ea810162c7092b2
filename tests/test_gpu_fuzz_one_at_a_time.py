"""An engine pair served one engine after the other (``tooling fuzz gpu
--one-engine-at-a-time``, a GPU that holds one engine of the pair only): real processes, with
an interpreter that stands in for vLLM's, since what is under test is how the pair's
processes are started, waited for and given their workloads."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

from tooling.fuzzing.gpu_case import GpuReq
from tooling.fuzzing.gpu_oracles import Mode
from tooling.fuzzing.gpu_pair import GpuTarget, given_workloads, judge_pair, run_pair

from .gpu_fuzz_parts import CASE

#: Stands in for the vLLM interpreter (``python -m gpu_run IN OUT``). Each engine notes
#: whether the other had started or ended when it started. The DFlash engine serves its
#: first workload and hangs in its second (or is refused, with REFUSE set); the plain
#: engine serves every workload it is given.
ENGINE_ALONE = """#!{python}
import json, os, sys, time
request = json.load(open(sys.argv[3]))
work = os.path.dirname(request["progress"])
other = "plain" if request["role"] == "dflash" else "dflash"
progress = {{
    "role": request["role"],
    "given": request["replay"],
    "drawn": request["workloads"],
    "other_started": os.path.exists(os.path.join(work, other + ".in.json")),
    "other_ended": os.path.exists(os.path.join(work, other + ".out.json")),
    "workloads": [],
}}
def write():
    json.dump(progress, open(request["progress"], "w"))
if request["role"] == "dflash":
    if os.environ.get("REFUSE"):
        progress["refused"] = "ValueError: not this setting"
        write()
        json.dump({{"ok": True, **progress}}, open(sys.argv[4], "w"))
        sys.exit(0)
    json.dump({{"block_size": 16}}, open(request["figures_file"], "w"))
    drawn = [[{{"arrival": 0, "prompt_len": 16 + w, "max_tokens": 4}}] for w in range(2)]
    progress["workloads"] = [{{"index": 0, "bound": 100, "requests": drawn[0]}}]
    progress.update(current=1, current_requests=drawn[1])
    write()
    time.sleep(600)
progress["workloads"] = [
    {{"index": i, "bound": 100, "requests": w}} for i, w in enumerate(request["replay"])
]
write()
json.dump({{"ok": True, **progress}}, open(sys.argv[4], "w"))
"""


def _target(tmp_path: Path, **env: str) -> GpuTarget:
    python = tmp_path / "python"
    python.write_text(ENGINE_ALONE.format(python=sys.executable))
    python.chmod(0o755)
    return GpuTarget(python=python, pair=tmp_path / "pair", env=env, cache_root=tmp_path / "c")


def test_the_plain_engine_starts_after_dflash_and_serves_what_dflash_was_given(tmp_path):
    """DFlash alone first, stopped at its limit in a workload (a hang); then plain alone, given
    the workload DFlash finished and the one it hung in, in that order; judged as a pair."""
    pair = run_pair(
        _target(tmp_path),
        CASE.settings,
        tmp_path / "work",
        3.0,
        kv_cache_memory_bytes=1 << 30,
        workloads=4,
        one_at_a_time=True,
    )
    dflash, plain = pair.runs["dflash"], pair.runs["plain"]
    assert dflash["other_started"] is False and dflash["drawn"] == 4 and dflash["given"] == []
    assert plain["other_started"] is True and plain["other_ended"] is False
    assert pair.stopped == {"dflash": True, "plain": False} and pair.seconds < 60
    expected = [[{"arrival": 0, "prompt_len": 16 + w, "max_tokens": 4}] for w in range(2)]
    assert plain["drawn"] == 0
    assert [[{k: r[k] for k in expected[0][0]} for r in w] for w in plain["given"]] == expected
    assert given_workloads(dflash) == [(GpuReq(**w[0]),) for w in expected]
    judged = judge_pair(pair, Mode())
    assert [(v.kind, v.engine, v.workload) for v in judged.verdicts] == [("hang", "dflash", 1)]


def test_a_replay_is_given_to_dflash_and_a_refusal_starts_no_plain_engine(tmp_path):
    pair = run_pair(
        _target(tmp_path, REFUSE="1"),
        CASE.settings,
        tmp_path / "work",
        30.0,
        kv_cache_memory_bytes=1 << 30,
        replay=[CASE.requests],
        one_at_a_time=True,
    )
    assert list(pair.runs) == ["dflash"] and pair.stopped == {"dflash": False}
    assert pair.runs["dflash"]["given"] == [[asdict(r) for r in CASE.requests]]
    assert not (tmp_path / "work" / "plain.in.json").exists()
    judged = judge_pair(pair, Mode())
    assert judged.refused == "ValueError: not this setting" and judged.verdicts == []
