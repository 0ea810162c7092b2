"""The GPU fuzzer's command and what it runs, with no GPU: its refusals (a pair it cannot
serve, no GPU, a replay file that is not a case), the driver and the engine pair on paper,
the vetting child, and the saved GPU findings' scheduler side on the CPU."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tooling.fuzzing.cases import read_case_file
from tooling.fuzzing.gpu_case import (
    GpuCase,
    GpuReq,
    GpuSettings,
    draw_settings,
    read_gpu_case_file,
)
from tooling.fuzzing.gpu_oracles import (
    Mode,
    RequestRun,
    judge_workload,
)
from tooling.fuzzing.gpu_pair import PairRun, judge_pair

from .gpu_fuzz_parts import CASE, GPU_CASES, done, lp, run
from .helpers import run_tooling
from .smoke_models import write_model, write_seed_pair

# -- the command's refusals ------------------------------------------------------------------


@pytest.fixture
def pair(tmp_path: Path) -> Path:
    folder = tmp_path / "pair"
    write_seed_pair(folder / "target", folder / "drafter", 10**9)
    return folder


def refusal(*args: str) -> tuple[int, str]:
    done = run_tooling("fuzz", "gpu", *args, timeout=300)
    return done.returncode, done.stderr.strip()


def test_a_vetting_child_that_cannot_import_vllm_leaves_the_draws_as_drawn(tmp_path, pair):
    """The real child, run by an interpreter without vLLM: it fails, says so in its log,
    and the campaign is told to serve every draw (None), not that all were refused."""
    from tooling.fuzzing.gpu_pair import GpuTarget, vet_settings

    target = GpuTarget(Path(sys.executable), pair)
    answer = vet_settings(target, [draw_settings(0, 0)], tmp_path / "vet", 1 << 30)
    assert answer is None
    assert json.loads((tmp_path / "vet" / "vet.out.json").read_text())["ok"] is False


def test_a_pair_it_cannot_serve_is_one_line_and_its_code(tmp_path, pair):
    code, err = refusal("--pair", str(tmp_path / "missing"), "--python", sys.executable)
    assert code == 29 and err.count("\n") == 0 and "no target/ folder" in err
    broken = tmp_path / "broken"
    write_model(broken / "target", json.loads((pair / "target" / "config.json").read_text()), 10**6)
    write_model(broken / "drafter", {"architectures": ["DFlashDraftModel"]}, 10**6)
    code, err = refusal("--pair", str(broken), "--python", sys.executable)
    assert code == 29 and err.count("\n") == 0 and "drafter" in err


def test_no_gpu_is_one_line_and_its_code(pair):
    """This interpreter has no torch at all: it sees no GPU."""
    code, err = refusal("--pair", str(pair), "--python", sys.executable)
    assert code == 30 and err.count("\n") == 0
    assert sys.executable in err and "no GPU" in err


@pytest.mark.slow
def test_the_probe_interpreter_sees_no_gpu(pair, probe_python):
    """torch without CUDA: ``torch.cuda.is_available()`` is false there. Without --python
    the command asks the probe interpreter, as ``tooling fuzz scheduler`` finds it."""
    done = run_tooling(
        "fuzz", "gpu", "--pair", str(pair), env={"TOOLING_PROBE_PYTHON": str(probe_python)}
    )
    assert done.returncode == 30, done.stderr
    assert "torch.cuda.is_available() is false" in done.stderr
    assert str(probe_python) in done.stderr and done.stderr.strip().count("\n") == 0


def test_a_replay_file_that_is_not_a_case_is_one_line_and_its_code(tmp_path, pair):
    bad = tmp_path / "case.json"
    bad.write_text(json.dumps({"format": "dflash-gpufuzz-case/1", "kind": "lossless"}))
    code, err = refusal("--pair", str(pair), "--python", sys.executable, "--replay", str(bad))
    assert code == 26 and err.count("\n") == 0 and str(bad) in err


def test_noise_mode_needs_its_noise(pair):
    code, err = refusal("--pair", str(pair), "--python", sys.executable, "--mode", "noise")
    assert code == 2 and "--noise" in err


# -- what the campaign hands the engine driver ----------------------------------------------


def test_the_driver_reads_the_request_the_campaign_writes_and_asks_for_the_engine():
    from tooling.fuzzing.serving.gpu_run import GpuRunRequest, _engine_request

    data = {
        "role": "dflash",
        "target": "/pair/target",
        "drafter": "/pair/drafter",
        "settings": vars(CASE.settings),
        "kv_cache_memory_bytes": 1 << 30,
        "figures_file": "/w/figures.json",
        "progress": "/w/dflash.progress.json",
        "replay": [[vars(r) for r in CASE.requests]],
    }
    request = GpuRunRequest.from_json(json.loads(json.dumps(data)))
    assert request.settings == CASE.settings and request.replay == [list(CASE.requests)]
    engine = _engine_request(request)
    assert engine.enforce_eager and engine.cudagraph_mode is None
    assert engine.num_speculative_tokens == 15 and engine.max_num_seqs is None
    assert engine.engine_args["enable_prefix_caching"] is True
    assert engine.engine_args["max_logprobs"] >= max(r.logprobs for r in CASE.requests)
    plain = _engine_request(replace(request, drafter=None, role="plain"))
    assert plain.drafter is None and plain.num_speculative_tokens == 0
    graphs = replace(request, settings=replace(CASE.settings, cudagraph_mode="FULL_DECODE_ONLY"))
    assert _engine_request(graphs).cudagraph_mode == "FULL_DECODE_ONLY"
    assert engine.speculative_args == {}  # unset: stock vLLM refuses the key, even as 0


def test_only_the_dflash_engine_is_given_the_hold():
    """A pair's settings go to both engines; the hold is the DFlash engine's speculative
    config's, so the plain engine serves as without it."""
    from tooling.fuzzing.serving.gpu_run import GpuRunRequest, _engine_request

    held = replace(CASE.settings, join_hold_steps=4)
    request = GpuRunRequest("dflash", "/t", "/d", held, 1 << 30, "/f", "/p")
    assert _engine_request(request).speculative_args == {"join_hold_steps": 4}
    plain = _engine_request(replace(request, drafter=None, role="plain"))
    assert plain.speculative_args == {} and plain.drafter is None
    both = replace(request, settings=replace(held, drafter_full_graphs=False))
    assert _engine_request(both).speculative_args == {
        "join_hold_steps": 4,
        "dflash_full_cudagraphs": False,
    }
    assert _engine_request(replace(both, drafter=None, role="plain")).speculative_args == {}


# -- the GPU host's step ---------------------------------------------------------------------


def test_the_host_step_refuses_before_it_starts_anything(tmp_path):
    from .helpers import run_gpu_script

    work, out = tmp_path / "work", tmp_path / "out"
    env = {k: "" for k in ("NOISE", "TIME_LIMIT", "FUZZ_ARGS")}
    done = run_gpu_script("gpu-fuzz.sh", "patched", "seed", work=work, out=out, **env)
    assert done.returncode == 2 and "gpu-fuzz.sh: NOISE is not set" in done.stderr
    done = run_gpu_script("gpu-fuzz.sh", "patched", "trained", work=work, out=out, **env)
    assert done.returncode == 28 and "no patched engine" in done.stderr
    (work / "engines" / "patched").mkdir(parents=True)
    done = run_gpu_script("gpu-fuzz.sh", "patched", "trained", work=work, out=out, **env)
    assert done.returncode == 28 and "no trained pair" in done.stderr
    assert not (out / "fuzz-patched-trained").exists()


# -- an engine pair's processes ---------------------------------------------------------------

#: Stands in for the vLLM interpreter (``python -m gpu_run IN OUT``): the DFlash engine hangs
#: in its first workload, the plain engine serves nothing and ends.
ENGINE_ON_PAPER = """#!{python}
import json, os, sys, time
request = json.load(open(sys.argv[3]))
progress = {{"role": request["role"], "workloads": [], "cache": os.environ["VLLM_CACHE_ROOT"],
            "multiprocessing": os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]}}
if request["role"] == "dflash":
    progress.update(current=0, current_requests=request["replay"][0])
    json.dump(progress, open(request["progress"], "w"))
    time.sleep(600)
json.dump({{"ok": True, **progress}}, open(sys.argv[4], "w"))
"""


def test_an_engine_pair_stopped_in_a_workload_is_a_hang_with_its_requests(tmp_path):
    from tooling.fuzzing.gpu_pair import GpuTarget, run_pair

    python = tmp_path / "python"
    python.write_text(ENGINE_ON_PAPER.format(python=sys.executable))
    python.chmod(0o755)
    target = GpuTarget(python=python, pair=tmp_path / "pair", cache_root=tmp_path / "cache")
    pair = run_pair(
        target,
        CASE.settings,
        tmp_path / "work",
        3.0,
        kv_cache_memory_bytes=1 << 30,
        replay=[CASE.requests],
    )
    assert pair.stopped == {"dflash": True, "plain": False} and pair.seconds < 60
    caches = {pair.runs[role]["cache"] for role in ("dflash", "plain")}
    assert caches == {str(tmp_path / "cache" / "dflash"), str(tmp_path / "cache" / "plain")}
    assert pair.runs["plain"]["multiprocessing"] == "0"
    judged = judge_pair(pair, Mode())
    assert [(v.kind, v.engine, v.workload) for v in judged.verdicts] == [("hang", "dflash", 0)]
    assert [GpuReq(**r) for r in judged.requests_of[0]] == list(CASE.requests)


def test_a_request_refused_by_one_engine_only_is_a_finding():
    out = {"r0": done([5], [lp(-0.1, -3)])}
    refused = {"r0": RequestRun([], refused="ValueError: the prompt is too long")}
    assert judge_workload(run(refused), run(refused), Mode()) == []
    (verdict,) = judge_workload(run(refused), run(out), Mode())
    assert verdict.kind == "lossless" and "refused by one engine only" in verdict.detail


@pytest.mark.slow
def test_a_findings_scheduler_side_replays_on_the_cpu(probe_python, upstream_0201, tmp_path):
    """The file saved beside a GPU finding is a case ``tooling fuzz scheduler --replay``
    serves: the same settings and requests through vLLM's real scheduler."""
    from tooling.fuzzing.cases import write_case_file
    from tooling.fuzzing.gpu_case import scheduler_case_file

    case = GpuCase(
        GpuSettings(k=3, max_model_len=512, prefix_caching=True),
        (GpuReq(0, 16, 8, logprobs=5), GpuReq(2, 4, 30, stop=True)),
    )
    path = tmp_path / "finding-lossless-0-0.scheduler.json"
    write_case_file(path, scheduler_case_file(case, "the scheduler side"))
    done = run_tooling(
        "fuzz",
        "scheduler",
        "--root",
        str(upstream_0201.source_dir),
        "--replay",
        str(path),
        "--out",
        str(tmp_path / "out"),
        "--json",
        env={"TOOLING_PROBE_PYTHON": str(probe_python)},
    )
    assert done.returncode == 0, done.stderr
    (replayed,) = json.loads(done.stdout)["replayed"]
    assert replayed["outcome"] == "pass" and replayed["steps"] > 8


def test_k_stays_within_the_drafters_block(pair):
    from tooling.fuzzing.gpu_pair import check_pair

    shape = check_pair(pair)
    assert shape.max_k == 15 and shape.vocab_size == 248320
    capped = [draw_settings(1, n, max_k=7) for n in range(100)]
    assert {s.k for s in capped} == {1, 3, 5, 7}
    full = [draw_settings(1, n) for n in range(100)]
    assert [replace(s, k=0) for s in capped] == [replace(s, k=0) for s in full]


def test_a_pair_whose_dflash_engine_did_not_start_stops_its_plain_engine_at_once(tmp_path):
    """Real processes: the DFlash engine writes that it failed and ends; the plain engine,
    still starting, is stopped then (it has nothing to serve), not left to the deadline, and
    neither reads as a hang. A pair that serves on is waited for, and one past the deadline
    is stopped and marked."""
    import time

    from tooling.fuzzing.gpu_pair import wait_pair
    from tooling.procs import start_group, stop_group

    figures = tmp_path / "figures.json"
    failed = f"import json; json.dump({{'failed': 'refused'}}, open({str(figures)!r}, 'w'))"

    def started(code: str, name: str):
        return start_group([sys.executable, "-c", code], log=tmp_path / f"{name}.log", env={})

    procs = {
        "dflash": started(failed, "dflash"),
        "plain": started("import time; time.sleep(60)", "p"),
    }
    began = time.monotonic()
    try:
        assert wait_pair(procs, figures, began + 50) == {"dflash": False, "plain": False}
        assert time.monotonic() - began < 30
    finally:
        for proc in procs.values():
            stop_group(proc, grace_s=1.0)
    figures.unlink()
    procs = {"dflash": started("import time; time.sleep(60)", "d2"), "plain": started("pass", "p2")}
    try:
        assert wait_pair(procs, figures, time.monotonic() + 2) == {"dflash": True, "plain": False}
    finally:
        for proc in procs.values():
            stop_group(proc, grace_s=1.0)


# -- a workload cut at its pair's time -------------------------------------------------------

#: Run in the probe interpreter with a vLLM tree on its path: the campaign's driver over an
#: engine that serves on (a token a request each step, none ever finished), its workload cut
#: once its time has passed. vLLM's engine is not what is tested here: the driver is. The
#: driver's clock is the engine's step count, so where it cuts does not hang on speed.
DRIVER_PAST_ITS_TIME = """
import json, sys
from types import SimpleNamespace
import tooling.fuzzing.serving.gpu_run as gpu_run
from tooling.fuzzing.gpu_case import GpuReq, GpuSettings
from tooling.fuzzing.serving.gpu_run import Driver, GpuRunRequest
from tooling.smoke.serving.distribution import RunningCounter

clock = [0.0]
gpu_run.time = SimpleNamespace(monotonic=lambda: clock[0])

class ServesOn:
    def __init__(self):
        self.live, self.aborted, self.steps = {}, [], 0
    def add_request(self, rid, prompt, params):
        self.live[rid] = []
    def abort_request(self, rids):
        self.aborted += [r for r in rids if r in self.live]
        for r in rids:
            self.live.pop(r, None)
    def has_unfinished_requests(self):
        return bool(self.live)
    def get_num_unfinished_requests(self):
        return len(self.live)
    def step(self):
        self.steps += 1
        clock[0] += 1.0
        outs = []
        for rid, tokens in self.live.items():
            tokens.append(7)
            done = SimpleNamespace(token_ids=list(tokens), logprobs=None, finish_reason=None)
            outs.append(SimpleNamespace(request_id=rid, outputs=[done], finished=False))
        return outs

engine = ServesOn()
request = GpuRunRequest("plain", "/t", None, GpuSettings(k=3), 1, "/f", "/p", vocab_size=64)
driver = Driver(request, engine, RunningCounter())
reqs = [GpuReq(0, 8, max_tokens=10**6), GpuReq(arrival=10**6, prompt_len=4, max_tokens=2)]
record = driver.run(0, reqs, float(sys.argv[1]))
print(json.dumps({"record": record, "aborted": engine.aborted, "steps": engine.steps}))
"""


def on_stock(probe_python: Path, upstream: Any, script: str, *args: str) -> Any:
    """``script`` run by the probe interpreter with stock ``upstream`` on its path: the JSON
    its last line prints."""
    return on_tree(probe_python, Path(upstream.source_dir), script, *args)


def on_tree(probe_python: Path, tree: Path, script: str, *args: str) -> Any:
    """``script`` run by the probe interpreter with the vLLM tree ``tree`` on its path: the
    JSON its last line prints."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": f"{tree}:{Path.cwd()}"}
    done = subprocess.run(
        [str(probe_python), "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_the_interpreter_check_tells_the_fixed_vllm_from_stock(
    probe_python, upstream_0201, patched_0201
):
    """The question the campaign asks its interpreter before drawing, on the real trees:
    patched 0.20.1 takes ``join_hold_steps`` (the hold is drawn), stock does not."""
    from tooling.fuzzing.gpu_pair import CHECK

    stock = on_tree(probe_python, Path(upstream_0201.source_dir), CHECK)
    fixed = on_tree(probe_python, Path(patched_0201.work_dir), CHECK)
    assert stock["vllm"] and fixed["vllm"]
    assert (stock["join_hold"], fixed["join_hold"]) == (False, True)


@pytest.mark.slow
def test_a_workload_past_its_time_is_cut_by_the_driver_not_left_to_hang(
    probe_python, upstream_0201
):
    """A pair's engine still stepping when its time runs out (an eager engine decoding
    thousands of tokens beside the training) ends the workload itself, with every request
    aborted and the step it ended at: the campaign then finds the process gone, no hang."""
    answer = on_stock(probe_python, upstream_0201, DRIVER_PAST_ITS_TIME, "5.5")
    record = answer["record"]
    assert record["error"] is None and record["cut"] == 6 == answer["steps"]
    assert answer["aborted"] == ["w0r0"]
    assert len(record["scheduled"]) == record["cut"] < record["bound"]
    assert "finished" not in record["results"]["r0"] and "r1" not in record["results"]


def test_a_cut_workload_is_no_hang_and_compares_what_both_engines_finished():
    """The record of a cut workload: an unfinished request is no livelock, a request both
    engines finished is still compared, and the pair counts the workload as cut."""
    same = done([5, 6], [lp(-0.1, -3.0), lp(-0.1, -3.0, (6, 2))])
    other = done([5, 9], [lp(-0.1, -3.0), lp(-0.1, -3.0, (9, 2))])
    left = RequestRun([5], [lp(-0.1, -3.0)], added=0, finished=None)
    d = run({"r0": same, "r1": left}, cut=40)
    p = run({"r0": same, "r1": replace(left, tokens=[5, 6], finished=3)})
    assert [v.kind for v in judge_workload(d, p, Mode())] == []
    assert "livelock" in [v.kind for v in judge_workload(replace(d, cut=None), p, Mode())]
    d_other = run({"r0": other, "r1": left}, cut=40)
    assert [v.kind for v in judge_workload(d_other, p, Mode())] == ["lossless"]
    as_json = {"index": 0, "bound": 64, "results": {}, "cut": 40, "requests": []}
    pair = PairRun(
        {
            "dflash": {"workloads": [as_json], "current": None},
            "plain": {"workloads": [{**as_json, "cut": None}], "current": None},
        },
        10.0,
        {"dflash": False, "plain": False},
    )
    judged = judge_pair(pair, Mode())
    assert judged.verdicts == [] and judged.cut == 1 and judged.served == 1


@pytest.mark.parametrize("path", GPU_CASES, ids=lambda p: p.stem)
def test_every_saved_gpu_finding_is_a_case_whose_scheduler_side_is_kept(path):
    """A GPU finding is kept as a case ``tooling fuzz gpu --replay`` serves again, and the
    part of it the CPU reproduces, its scheduler side, is kept among the scheduler fuzzer's
    regression cases (which test_sched_fuzz replays on stock and on the fixed tree)."""
    from tooling.fuzzing.gpu_case import scheduler_case_file

    saved = read_gpu_case_file(path)
    assert saved.kind != "pass"
    side = json.loads(json.dumps(scheduler_case_file(saved.case, "").case))
    kept = [
        read_case_file(p)
        for p in sorted((Path(__file__).parent / "data" / "sched-fuzz").glob("*.json"))
    ]
    assert any(k.case == side and k.kind != "pass" for k in kept), path.name


VET_ON_THE_CPU = """
import json, sys
from dataclasses import asdict
from pathlib import Path
from tooling.probes import _harness
_harness.install_cpu_platform()
from tooling.fuzzing.gpu_case import GpuSettings
from tooling.fuzzing.serving import gpu_vet

pair = _harness.hybrid_pair(Path(sys.argv[1]))
settings = [
    GpuSettings(k=3, max_num_batched_tokens=8, max_num_seqs=8, max_model_len=1024),
    GpuSettings(k=3, max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=1024),
]
request = {
    "target": str(pair.target),
    "drafter": str(pair.drafter),
    "settings": [asdict(s) for s in settings],
    "kv_cache_memory_bytes": 1 << 30,
    "vocab_size": 512,
}
print(json.dumps(gpu_vet.vet(request)))
"""


@pytest.mark.slow
def test_the_vetting_child_answers_with_vllms_own_config(probe_python, upstream_0201, tmp_path):
    """The real vetting child on vLLM's real config (stock 0.20.1, a hybrid target and a
    DFlash drafter, on the CPU platform the probes give vLLM): a step budget the drafts
    leave no token in is refused with vLLM's own line, a setting that fits passes, and
    the child returns with no engine started."""
    refused = on_stock(probe_python, upstream_0201, VET_ON_THE_CPU, str(tmp_path / "pair"))[
        "refused"
    ]
    assert refused[1] is None
    assert refused[0] is not None and "max_num_scheduled_tokens" in refused[0]
