"""The smoke's contact points with vLLM 0.20.1's own code, on a CPU (slow).

In the probe interpreter with the pristine 0.20.1 tree, and with the
patched tree, first on the path:
- vLLM's PrometheusStatLogger writes /metrics text, which our parser reads;
- vLLM's ``serve`` argument parser accepts the argv ``build_serve_command`` makes;
- vLLM's CompletionResponse serialises to what ``parse_completion`` reads;
- the DFlash drafter vLLM builds reports per-layer windows through the same
  ``attention_windows`` the GPU run uses, and the V1 runner's aux-layer
  resolver answers for the drafter config: the check verdicts must be FAIL on
  the pristine tree and PASS on the patched one;
- ``install_recorder`` binds to the real ``DFlashProposer.propose``;
- the slot auditor's hooks bind to the real ``Scheduler.schedule`` (which the
  async scheduler inherits), ``DFlashProposer.set_inputs_first_pass`` and its
  Triton kernel (interpreted), with an attention and a Mamba KV-cache group;
  the boundary prompt, served alone, fails check 8 on the pristine tree (its
  last query slot has no block) and passes it on the patched one.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tooling.smoke import checks
from tooling.smoke.client import parse_completion
from tooling.smoke.config import EngineSettings, drafter_info_from_config
from tooling.smoke.metrics import parse_prometheus, prefix_cache_counters, spec_decode_stats
from tooling.smoke.server import ServeOptions, build_serve_command

from .helpers import run_on_tree

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    # The DFlash first-pass kernel runs in Triton's interpreter (section 6).
    os.environ["TRITON_INTERPRET"] = "1"
    from tooling.probes import _harness
    _harness.install_cpu_platform()
    import torch
    from vllm.platforms import current_platform
    # The proposer's buffers (section 6) ask for pinned memory, which needs an accelerator.
    type(current_platform).is_pin_memory_available = classmethod(lambda cls: False)

    argvs, out_path = json.loads(sys.argv[1]), sys.argv[2]
    out = {}

    # 1. /metrics from vLLM's own logger: a 200-token prompt twice, six drafts.
    import prometheus_client
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    pair = _harness.write_tiny_pair(
        _harness.scratch_dir(), target_layers=8, target_layer_ids=[1, 3, 5],
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=16,
    )
    config = _harness.vllm_config(pair, prefix_caching=True)
    logger = PrometheusStatLogger(config)
    for queries, hits, accepted in ((200, 0, [0, 1, 3, 2]), (200, 192, [1, 0])):
        cache = PrefixCacheStats()
        cache.record(num_tokens=queries, num_hits=hits, preempted=False)
        spec = SpecDecodingStats.new(3)
        for n in accepted:
            spec.observe_draft(num_draft_tokens=3, num_accepted_tokens=n)
        logger.record(SchedulerStats(prefix_cache_stats=cache, spec_decoding_stats=spec), None)
    out["metrics"] = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()

    # 2. Our serve argvs through vLLM's serve parser.
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subcommand"))
    out["args"] = [{k: getattr(args, k) for k in (
        "subcommand", "model_tag", "host", "port", "served_model_name", "attention_backend",
        "max_model_len", "gpu_memory_utilization", "seed", "block_size", "generation_config",
        "enable_prompt_tokens_details", "enable_prefix_caching", "enforce_eager",
        "speculative_config", "kv_cache_dtype", "tensor_parallel_size", "max_num_seqs",
        "language_model_only", "kv_cache_memory_bytes", "disable_custom_all_reduce",
        "distributed_executor_backend")}
        for args in map(parser.parse_args, argvs)]

    # 3. A completion answer as vLLM serialises it.
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionResponse, CompletionResponseChoice)
    from vllm.entrypoints.openai.engine.protocol import PromptTokenUsageInfo, UsageInfo
    answer = CompletionResponse(
        model="smoke",
        choices=[CompletionResponseChoice(index=0, text=" x y", finish_reason="length",
                                          token_ids=[7, 8])],
        usage=UsageInfo(prompt_tokens=200, completion_tokens=2, total_tokens=202,
                        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=176)),
    )
    out["completion"] = json.loads(answer.model_dump_json())

    # 4. The drafter vLLM builds, read the way the GPU run reads it.
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from tooling.smoke.serving.engine_run import (
        ProposalRecorder, attention_windows, install_recorder,
    )
    spec_config = _harness.vllm_config(pair).speculative_config
    _harness.ensure_single_process_group(config)
    torch.set_default_dtype(torch.bfloat16)
    with set_current_vllm_config(config):
        drafter = DFlashQwen3Model(vllm_config=config, prefix="model")
    torch.set_default_dtype(torch.float32)
    out["windows"] = attention_windows(drafter)
    runner = object.__new__(GPUModelRunner)
    runner.speculative_config = spec_config
    out["aux_layers"] = list(GPUModelRunner._get_eagle3_aux_layers_from_config(runner))
    out["drafter_config"] = json.load(open(pair.drafter / "config.json"))

    # 5. The proposal recorder on the real proposer class.
    from vllm.v1.spec_decode.dflash import DFlashProposer
    original = DFlashProposer.propose
    install_recorder(DFlashProposer, ProposalRecorder())
    out["recorder_wraps"] = DFlashProposer.propose.__wrapped__ is original

    # 6. The slot auditor's hooks on the real Scheduler (an attention group and a
    # Mamba group in align mode, as a hybrid target has) and the real DFlash
    # first pass, its Triton kernel reading a real MultiGroupBlockTable. The
    # runner's drafting step is stood in for by a subclass that hands the first
    # pass what GPUModelRunner hands it: the drafter group's block table and the
    # scheduled tokens' positions.
    from types import SimpleNamespace
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec)
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.block_table import MultiGroupBlockTable
    from tooling.smoke.serving.engine_run import SlotAuditor

    block = 16
    config = _harness.vllm_config(pair, prefix_caching=True)
    config.cache_config.mamba_cache_mode = "align"
    config.cache_config.num_gpu_blocks = 64
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["attn"], FullAttentionSpec(
            block_size=block, num_kv_heads=1, head_size=1, dtype=torch.float32)),
        KVCacheGroupSpec(["mamba"], MambaSpec(
            block_size=block, shapes=((16,),), dtypes=(torch.float32,), mamba_cache_mode="align")),
    ])
    with set_current_vllm_config(config):
        proposer = DFlashProposer(config, torch.device("cpu"), runner=None)
    proposer.block_size, proposer.kv_cache_gid = block, 0

    class Runner(GPUModelRunner):
        def __init__(self):
            self.input_batch = SimpleNamespace(req_ids=[], block_table=MultiGroupBlockTable(
                max_num_reqs=4, max_model_len=1024, max_num_batched_tokens=1024,
                pin_memory=False, device=torch.device("cpu"), block_sizes=[block, block],
                kernel_block_sizes=[block, block]))

        def propose_draft_token_ids(self, scheduler_output):
            new = scheduler_output.scheduled_new_reqs
            self.input_batch.req_ids = [r.req_id for r in new]
            for row, r in enumerate(new):
                self.input_batch.block_table.add_row(r.block_ids, row)
            self.input_batch.block_table.commit_block_table(len(new))
            lens = [scheduler_output.num_scheduled_tokens[r.req_id] for r in new]
            starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            n = int(starts[-1])
            cad = CommonAttentionMetadata(
                query_start_loc=starts, query_start_loc_cpu=starts,
                seq_lens=torch.tensor(lens, dtype=torch.int32), num_reqs=len(new),
                num_actual_tokens=n, max_query_len=max(lens), max_seq_len=max(lens),
                block_table_tensor=self.input_batch.block_table[0].get_device_tensor(len(new)),
                slot_mapping=torch.zeros(n, dtype=torch.int64))
            return proposer.set_inputs_first_pass(
                target_token_ids=torch.zeros(n, dtype=torch.int32),
                next_token_ids=torch.ones(len(new), dtype=torch.int32),
                target_positions=torch.cat([torch.arange(length) for length in lens]),
                target_hidden_states=torch.zeros(n, 8), token_indices_to_sample=None,
                cad=cad, num_rejected_tokens_gpu=None)

    def new_scheduler(prompts):
        scheduler = Scheduler(
            vllm_config=config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config), block_size=block,
            log_stats=False)
        for request_id, ids in prompts.items():
            scheduler.add_request(Request(
                request_id=request_id, prompt_token_ids=ids,
                sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                block_hasher=hasher))
        return scheduler

    auditor = SlotAuditor()
    auditor.install(Scheduler, Runner, DFlashProposer)
    auditor.runner = Runner()
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block, sha256)
    scheduler = new_scheduler(
        {f"r{i}": list(range(100 * i + 1, 100 * i + 1 + n)) for i, n in enumerate((32, 40))})
    scheduled = scheduler.schedule()
    auditor.runner.propose_draft_token_ids(scheduled)
    out["audit"] = {
        # async scheduling (0.20.1's default with DFlash) runs AsyncScheduler.schedule
        "async_scheduler_inherits_schedule": "schedule" not in vars(AsyncScheduler),
        "snapshot_is_of_this_step": auditor.pending[-1][0] is scheduled,
        "snapshot": auditor.pending[-1][1],
        "scheduled": {r.req_id: r.block_ids for r in scheduled.scheduled_new_reqs},
        "counts": auditor.audit.to_json(),
    }
    # The engine run's boundary prompt, served alone on a fresh scheduler and block
    # table: its first pass ends on the first slot of block 1.
    from tooling.smoke.serving.slotaudit import SlotAudit, boundary_prompt_length
    length = boundary_prompt_length(block, proposer.num_speculative_tokens, 4, 1024)
    auditor.audit, auditor.runner = SlotAudit(), Runner()
    scheduler = new_scheduler({"boundary": list(range(500, 500 + length))})
    auditor.runner.propose_draft_token_ids(scheduler.schedule())
    out["boundary"] = {"length": length, "counts": auditor.audit.to_json()}

    # 5. The preflight fills vLLM's model-info cache with what vLLM itself reads back.
    import tempfile
    from tooling.smoke.serving import preflight
    from vllm.model_executor.models import registry
    cache = tempfile.mkdtemp()
    os.environ["VLLM_CACHE_ROOT"] = cache
    archs = ["Qwen3ForCausalLM", "DFlashDraftModel"]
    preflight.main([os.path.join(cache, "preflight.json"), json.dumps(archs)])

    def no_subprocess(fn):
        raise AssertionError("vLLM inspected a model class in a subprocess")

    registry._run_in_subprocess = no_subprocess
    out["modelinfo"] = {
        "preflight": json.load(open(os.path.join(cache, "preflight.json"))),
        "files": sorted(os.listdir(os.path.join(cache, "modelinfos"))),
        "read_back": [registry.ModelRegistry.models[a].inspect_model_cls().architecture
                      for a in archs],
    }
    json.dump(out, open(out_path, "w"))
    """
)


SERVE_ARGVS = [
    build_serve_command(
        ServeOptions("/models/target", "/models/drafter", EngineSettings(), port=8123), "python"
    ),
    # The hybrid target's server with every production option the smoke passes.
    build_serve_command(
        ServeOptions(
            "/models/target",
            "/models/drafter",
            EngineSettings(
                block_size=None,
                enforce_eager=True,
                kv_cache_dtype="fp8",
                tensor_parallel_size=2,
                disable_custom_all_reduce=True,
                distributed_executor_backend="ray",
                max_num_seqs=4,
                kv_cache_memory_bytes=4 << 30,
            ),
            port=8124,
            language_model_only=True,
        ),
        "python",
    ),
]


def _observe(probe_python: Path, tree: Path, tmp: Path) -> dict:
    # argv after "python -m vllm.entrypoints.cli.main": what vLLM's CLI parses.
    argvs = json.dumps([argv[3:] for argv in SERVE_ARGVS])
    return run_on_tree(probe_python, tree, tmp, SCRIPT, argvs, timeout=300)


@pytest.fixture(scope="session")
def stock(probe_python: Path, upstream_0201, tmp_path_factory) -> dict:
    return _observe(probe_python, upstream_0201.source_dir, tmp_path_factory.mktemp("stock"))


@pytest.fixture(scope="session")
def patched(probe_python: Path, patched_0201, tmp_path_factory) -> dict:
    assert patched_0201.ok
    return _observe(probe_python, Path(patched_0201.work_dir), tmp_path_factory.mktemp("patched"))


def test_metrics_written_by_vllm_parse(stock) -> None:
    samples = parse_prometheus(stock["metrics"])
    counters = prefix_cache_counters(samples)
    assert counters is not None
    assert (counters.queries, counters.hits) == (400.0, 192.0)
    stats = spec_decode_stats(samples)
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (6, 18, 7)
    assert stats.accepted_per_position == [4.0, 2.0, 1.0]
    assert stats.acceptance_length == pytest.approx(1 + 7 / 6)


def test_vllm_accepts_our_serve_argv(stock) -> None:
    args, production = stock["args"]
    assert args["subcommand"] == "serve"
    assert args["model_tag"] == "/models/target"
    assert (args["host"], args["port"]) == ("127.0.0.1", 8123)
    assert args["served_model_name"] == ["smoke"]
    assert args["attention_backend"] == "FLASH_ATTN"
    assert (args["max_model_len"], args["gpu_memory_utilization"]) == (1024, 0.3)
    assert (args["seed"], args["block_size"]) == (0, 16)
    assert args["generation_config"] == "vllm"
    assert args["enable_prompt_tokens_details"] is True
    assert args["enable_prefix_caching"] is True
    # Compiled graphs by default: no --enforce-eager.
    assert args["enforce_eager"] is False
    assert (args["kv_cache_dtype"], args["tensor_parallel_size"], args["max_num_seqs"]) == (
        "auto",
        1,
        8,
    )
    assert args["language_model_only"] is False
    assert args["speculative_config"] == {
        "method": "dflash",
        "model": "/models/drafter",
        "num_speculative_tokens": 3,
    }
    assert production["block_size"] is None  # vLLM sizes a hybrid target's blocks
    assert production["enforce_eager"] is True
    assert (production["kv_cache_dtype"], production["tensor_parallel_size"]) == ("fp8", 2)
    assert production["max_num_seqs"] == 4
    assert production["language_model_only"] is True
    assert production["kv_cache_memory_bytes"] == 4 << 30
    assert args["kv_cache_memory_bytes"] is None
    assert (production["disable_custom_all_reduce"], args["disable_custom_all_reduce"]) == (
        True,
        False,
    )
    # vLLM's own choice unless asked (None: mp on one host at TP > 1).
    assert (production["distributed_executor_backend"], args["distributed_executor_backend"]) == (
        "ray",
        None,
    )


def _check_audit_hooks(audit: dict) -> None:
    assert audit["async_scheduler_inherits_schedule"] is True
    assert audit["snapshot_is_of_this_step"] is True
    owners, block_sizes = audit["snapshot"]["owners"], audit["snapshot"]["block_sizes"]
    assert block_sizes == [16, 16]
    # Both groups (attention, Mamba) list both requests with the blocks the step assigned.
    for group, blocks in enumerate(owners):
        assert blocks == {req: ids[group] for req, ids in audit["scheduled"].items()}
    counts = audit["counts"]
    assert (counts["passes"], counts["unaudited_passes"], counts["unknown_rows"]) == (1, 0, 0)
    assert counts["slots"] == 8  # two requests, 1 + K query slots each


def test_slot_audit_hooks_bind_to_the_real_scheduler_and_first_pass(stock) -> None:
    _check_audit_hooks(stock["audit"])
    counts = stock["audit"]["counts"]
    # Stock 0.20.1 reserves no lookahead on a first prefill: all 8 query slots
    # (positions past the scheduled chunk) read unassigned block-table entries.
    assert (counts["outside"], counts["null_block"], counts["other_live"]) == (8, 8, 0)
    assert {e["position"] for e in counts["examples"]} == {16, 17, 18, 19}


def test_slot_audit_hooks_bind_on_the_patched_tree(patched) -> None:
    _check_audit_hooks(patched["audit"])
    # With the lookahead reserved, each query slot lies in the very block the request holds
    # for its position, in the order vLLM's KV-cache manager lists them.
    counts = patched["audit"]["counts"]
    assert (counts["outside"], counts["misplaced"], counts["other_live"]) == (0, 0, 0)


def _boundary_verdict(observed: dict) -> checks.CheckResult:
    boundary = observed["boundary"]
    assert boundary["length"] == 13  # 16-token blocks, K=3: positions 13..16
    counts = boundary["counts"]
    assert (counts["passes"], counts["slots"], counts["boundary_rows"]) == (1, 4, 1)
    return checks.check_slot_audit(counts)


def test_boundary_prompt_fails_the_slot_audit_on_the_stock_tree(stock) -> None:
    result = _boundary_verdict(stock)
    assert result.status == checks.FAIL, result.evidence
    # Stock 0.20.1 reserves no lookahead on a first prefill: one block for 13 tokens.
    counts = stock["boundary"]["counts"]
    assert (counts["outside"], counts["null_block"]) == (1, 1)
    assert [e["position"] for e in counts["examples"]] == [16]


def test_boundary_prompt_passes_the_slot_audit_on_the_patched_tree(patched) -> None:
    result = _boundary_verdict(patched)
    assert result.status == checks.PASS, result.evidence


def test_vllm_completion_answer_parses(stock) -> None:
    parsed = parse_completion(stock["completion"])
    assert parsed.token_ids == (7, 8)
    assert parsed.cached_tokens == 176
    assert parsed.prompt_tokens == 200


def test_recorder_binds_to_the_real_proposer(stock) -> None:
    assert stock["recorder_wraps"] is True


def test_stock_tree_fails_checks_2_and_3(stock) -> None:
    info = drafter_info_from_config(stock["drafter_config"])
    aux = checks.check_aux_layers(tuple(stock["aux_layers"]), info.expected_aux_layers(), "x")
    assert aux.status == checks.FAIL
    assert stock["aux_layers"] == [1, 3, 5]
    windows = checks.check_windows(stock["windows"], info.expected_windows())
    assert windows.status == checks.FAIL
    assert [w["window"] for w in stock["windows"]] == [[-1, -1]] * 3
    assert [w["layer"] for w in stock["windows"]] == [
        f"layers.{i}.self_attn.attn" for i in range(3)
    ]


def test_patched_tree_passes_checks_2_and_3(patched) -> None:
    info = drafter_info_from_config(patched["drafter_config"])
    aux = checks.check_aux_layers(tuple(patched["aux_layers"]), info.expected_aux_layers(), "x")
    assert aux.status == checks.PASS, aux.evidence
    windows = checks.check_windows(patched["windows"], info.expected_windows())
    assert windows.status == checks.PASS, windows.evidence


def test_preflight_answers_vllms_model_class_inspection_ahead(stock) -> None:
    """The run's engines then read vLLM's model-info cache instead of each inspecting
    both classes in a subprocess of its own, a slow step of every engine start."""
    info = stock["modelinfo"]
    assert info["preflight"]["modelinfo_error"] is None
    assert info["files"] == [
        "vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json",
        "vllm-model_executor-models-qwen3_dflash-DFlashQwen3ForCausalLM.json",
    ]
    # Read back by vLLM's own lookup, with its subprocess path made to fail.
    assert info["read_back"] == ["Qwen3ForCausalLM", "DFlashQwen3ForCausalLM"]
