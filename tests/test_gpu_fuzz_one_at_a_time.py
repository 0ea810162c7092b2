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


#: The same stand-in for the whole command: it answers the campaign's interpreter check (a
#: GPU, a vLLM with both options), fails the settings' vetting (so the pair starts as drawn),
#: and serves as each engine: DFlash one workload of its own and ends, plain what it is given.
COMMAND_ALONE = """#!{python}
import json, os, sys
if sys.argv[1] == "-c":
    print(json.dumps({{"gpu": True, "why": "", "vllm": "/standin/vllm/__init__.py",
                      "join_hold": True, "drafter_graphs": True}}))
    sys.exit(0)
module, in_file, out_file = sys.argv[2:5]
if module.endswith("gpu_vet"):
    sys.exit(1)
request = json.load(open(in_file))
work = os.path.dirname(request["progress"])
given = request["replay"] or [[{{"arrival": 0, "prompt_len": 17, "max_tokens": 4}}]]
progress = {{
    "role": request["role"],
    "other_ended": os.path.exists(os.path.join(work, "dflash.out.json")),
    "workloads": [{{"index": i, "bound": 100, "requests": w}} for i, w in enumerate(given)],
}}
if request["role"] == "dflash":
    json.dump({{"block_size": 16}}, open(request["figures_file"], "w"))
json.dump(progress, open(request["progress"], "w"))
json.dump({{"ok": True, **progress}}, open(out_file, "w"))
"""


def test_the_command_serves_each_pair_one_engine_at_a_time(tmp_path):
    """``tooling fuzz gpu --one-engine-at-a-time``: the campaign's pair serves its plain
    engine after its DFlash engine has ended, with the workload DFlash served; without the
    flag, both start at once and each draws the workloads itself."""
    import json

    from .helpers import run_tooling
    from .smoke_models import write_seed_pair

    pair = tmp_path / "pair"
    write_seed_pair(pair / "target", pair / "drafter", 10**9)
    python = tmp_path / "python"
    python.write_text(COMMAND_ALONE.format(python=sys.executable))
    python.chmod(0o755)
    seen = {}
    for flag in ("--one-engine-at-a-time", None):
        out = tmp_path / f"out-{bool(flag)}"
        args = ["--pair", str(pair), "--python", str(python), "--settings", "1"]
        args += ["--workloads", "1", "--pair-seconds", "60", "--no-shrink", "--out", str(out)]
        done = run_tooling("fuzz", "gpu", *args, *([flag] if flag else []), timeout=300)
        assert done.returncode in (0, 25), done.stderr
        (folder,) = (out / "pairs").iterdir()
        plain = json.loads((folder / "plain.progress.json").read_text())
        request = json.loads((folder / "plain.in.json").read_text())
        seen[flag] = plain["other_ended"], request["replay"]
    one_at_a_time = seen["--one-engine-at-a-time"]
    assert one_at_a_time[0] is True
    assert [[r["prompt_len"] for r in w] for w in one_at_a_time[1]] == [[17]]
    # At once, the stand-in's DFlash engine may end before the plain one starts: only what
    # each was given tells the two modes apart there.
    assert seen[None][1] == []
