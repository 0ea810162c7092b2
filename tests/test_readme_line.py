"""README's serving line as the GPU host serves it (``tooling.smoke.serving.readme_line``): the
line is README's, vLLM 0.20.1's own parser takes it, and the recorded run of the seed-shaped
pair at full width (tests/data/readme-line-5120, one H200) passes the prefix-caching verdict,
which a Mamba state of the wrong position fails."""

from __future__ import annotations

import copy
import json
import re
import shlex

import pytest

from tooling.paths import REPO_DIR
from tooling.smoke.serving import readme_line

from .helpers import run_on_tree

RUN = REPO_DIR / "tests" / "data" / "readme-line-5120"
VARIANTS = ("defaults", "prefix", "small-budget")


@pytest.fixture(scope="module")
def records() -> dict[str, dict]:
    return {n: json.loads((RUN / f"{n}.json").read_text()) for n in VARIANTS}


def _readme_line() -> list[str]:
    readme = (REPO_DIR / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```sh\n(vllm serve .*?)\n```", readme, re.S)
    assert block, "README has no vllm serve block"
    return shlex.split(block.group(1).replace("\\\n", " "))


def test_the_host_serves_readmes_line_and_nothing_else():
    line = _readme_line()
    assert line[:3] == ["vllm", "serve", "Qwen/Qwen3.6-27B"]
    spec = json.loads(line[line.index("--speculative-config") + 1])
    cmd = readme_line.serve_command("python3", "/t", "/d", 8000, [])
    ours = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert ours == {**spec, "model": "/d"}
    # README's flags, then only what the offline host needs (no flashinfer) and the port.
    readme_flags = [a for a in line[3:] if a != line[line.index("--speculative-config") + 1]]
    host_flags = [a for a in cmd[5:] if a != cmd[cmd.index("--speculative-config") + 1]]
    assert host_flags == [*readme_flags, "--gdn-prefill-backend", "triton", "--port", "8000"]


SCRIPT = """
import json, sys
from tooling.probes import _harness
_harness.install_cpu_platform()
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subcommand"))
keys = ("model_tag", "speculative_config", "language_model_only", "enable_prefix_caching",
        "default_chat_template_kwargs", "gdn_prefill_backend", "max_num_batched_tokens",
        "max_num_seqs")
out = [{k: getattr(parser.parse_args(a), k) for k in keys} for a in json.loads(sys.argv[1])]
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.mark.slow
def test_vllm_parses_every_variant(probe_python, upstream_0201, tmp_path):
    argvs = [
        readme_line.serve_command("p", "/t", "/d", 8000, readme_line.VARIANTS[n])[3:]
        for n in VARIANTS
    ]
    parsed = run_on_tree(
        probe_python, upstream_0201.source_dir, tmp_path, SCRIPT, json.dumps(argvs), timeout=300
    )
    defaults, prefix, small = parsed
    assert defaults["speculative_config"]["num_speculative_tokens"] == 15
    assert defaults["default_chat_template_kwargs"] == {"enable_thinking": False}
    assert (defaults["enable_prefix_caching"], defaults["max_num_seqs"]) == (None, None)
    assert prefix["enable_prefix_caching"] is True
    assert (small["max_num_batched_tokens"], small["max_num_seqs"]) == (512, 16)


def test_the_recorded_run_started_and_served_every_variant(records):
    for name, record in records.items():
        assert record["ok"], name
        assert record["wave"]["served"] == len(record["wave"]["lengths"]) == 16
    # vLLM's defaults at K = 15 started with the sequences patch 14 chose, logged once.
    assert any("max_num_seqs 273 (default 1024)" in line for line in records["defaults"]["log"])
    assert any(
        "Prefill chunks hold at most 288 tokens" in line for line in records["small-budget"]["log"]
    )
    hits = [m for m in records["small-budget"]["metrics"] if "prefix_cache_hits_total" in m]
    assert hits and hits[0].endswith(" 960.0")  # two 480-token blocks of the 1000-token prompt


def test_the_recorded_run_passes_the_prefix_verdict(records):
    assert readme_line.verdict(records) == []
    table = readme_line.compare(records)
    assert table["small-budget"]["hit_vs_cold"] == 0.0


def test_a_hit_from_a_state_of_another_position_fails_the_verdict(records):
    """The replaced-context run stands for what a hit computing from the Mamba state saved at
    position 288 instead of 480 gives: put in place of the hit, the verdict catches it."""
    doctored = copy.deepcopy(records)
    small = doctored["small-budget"]["requests"]
    small["long_hit"] = small["long_other"]
    wrong = readme_line.verdict(doctored)
    assert any("prefix hit's tokens differ" in w for w in wrong), wrong
