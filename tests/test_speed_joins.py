"""The speed run's window of prompts joining (``sustained.run_window`` with ``joins``): each
prompt marked from its arrival to its first token, one at a time, on an engine that answers
as vLLM's offline engine does under asynchronous scheduling (a prompt's first token comes a
step after the step that admits it). The engine stands in for vLLM's, which runs only on a
GPU host; the window, its marks and vLLM's request types are the real ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import run_on_tree

SCRIPT = """
import json, sys
from contextlib import contextmanager
from types import SimpleNamespace
from tooling.trained.serving import sustained

class Engine:
    '''A request is admitted the step after its arrival, makes its first token the step
    after that (asynchronous scheduling), then one a step until its max_tokens.'''

    def __init__(self, log):
        self.log, self.requests, self.steps = log, {}, 0

    def add_request(self, rid, prompt, params):
        self.requests[rid] = {"age": 0, "made": 0, "max": params.max_tokens}
        self.log.append(("add", rid))

    def step(self):
        self.steps += 1
        self.log.append(("step", self.steps))
        outputs = []
        for rid, r in list(self.requests.items()):
            r["age"] += 1
            if r["age"] < 2:
                continue
            r["made"] += 1
            done = r["made"] >= r["max"]
            outputs.append(SimpleNamespace(
                request_id=rid, finished=done,
                outputs=[SimpleNamespace(token_ids=list(range(r["made"])))],
            ))
            if done:
                del self.requests[rid]
        return outputs

    def abort_request(self, rids):
        for rid in rids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

def run(joins, level):
    log = []
    llm = SimpleNamespace(llm_engine=Engine(log), get_metrics=lambda: [])

    @contextmanager
    def mark():
        log.append(("open",))
        yield
        log.append(("close",))

    figures = sustained.run_window(
        llm, [[1, 2, 3]], level, 2, marker=mark, measured=4, joins=joins
    )
    return {"figures": {k: v for k, v in figures.items() if k != "step_ms"}, "log": log}

json.dump({"joins": run(True, 1), "steps": run(False, 1), "two": run(True, 2)},
          open(sys.argv[2], "w"))
"""


@pytest.mark.slow
def test_each_prompt_joining_is_marked_from_its_arrival_to_its_first_token(
    probe_python, upstream_0201, tmp_path
):
    seen = run_on_tree(
        probe_python, Path(upstream_0201.source_dir), tmp_path, SCRIPT, "", timeout=600
    )
    joins, steps = seen["joins"], seen["steps"]
    log = [tuple(e) for e in joins["log"]]
    opens = [i for i, e in enumerate(log) if e == ("open",)]
    closes = [i for i, e in enumerate(log) if e == ("close",)]
    # Of the window's four completions, the first's successor arrives before the window
    # opens: three prompts join inside it, each marked once, the marks never overlapping.
    assert joins["figures"]["joins_marked"] == 3 and len(opens) == len(closes) == 3
    assert all(o < c for o, c in zip(opens, closes, strict=True))
    assert all(c < o for c, o in zip(closes, opens[1:], strict=False))
    for o, c in zip(opens, closes, strict=True):
        # Opened right at a prompt's arrival; closed after the two steps that admit it and
        # give its first token, with no other step inside.
        assert log[o - 1][0] == "add"
        assert [e[0] for e in log[o + 1 : c]] == ["step", "step"]
    # The prompt that arrives with the window's completions all in is not marked.
    last_add = max(i for i, e in enumerate(log) if e[0] == "add")
    assert last_add > closes[-1] and ("open",) not in log[last_add:]
    assert joins["figures"]["completions"] == 4
    # Without joins every step inside the window is marked on its own.
    step_log = [tuple(e) for e in steps["log"]]
    marked = [step_log[i + 1] for i, e in enumerate(step_log) if e == ("open",)]
    assert marked and all(e[0] == "step" for e in marked)
    assert len(marked) == steps["figures"]["steps"]
    assert "joins_marked" not in steps["figures"]
    # Two requests at once: a prompt arriving while the other's mark is open is not marked.
    two = seen["two"]
    assert 0 < two["figures"]["joins_marked"] <= 3
    two_log = [tuple(e) for e in two["log"]]
    depth = 0
    for e in two_log:
        depth += {("open",): 1, ("close",): -1}.get(e, 0)
        assert depth in (0, 1)
