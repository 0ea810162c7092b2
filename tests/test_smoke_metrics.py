"""Parsing vLLM's /metrics and the aux-layer log line.

The fixture is /metrics text produced by vLLM 0.20.1's own PrometheusStatLogger
(v1/metrics/loggers.py, spec_decode/metrics.py) after two scheduler steps: a
200-token prompt sent twice (second one 192 tokens from the cache) and six
drafts of three tokens with 0, 1, 3, 2, 1 and 0 accepted. Trimmed to fewer
metrics (long help texts cut); every kept line is verbatim. The slow test in
test_smoke_vllm_cpu.py regenerates the full text from vLLM's code and parses it.
"""

from __future__ import annotations

import math

import pytest

from tooling.smoke import metrics
from tooling.smoke.logscan import aux_layers_from_log, aux_layers_from_log_file, block_size_from_log

VLLM_0201_METRICS = """\
# HELP python_info Python platform information
# TYPE python_info gauge
python_info{implementation="CPython",major="3",minor="11",patchlevel="7",version="3.11.7"} 1.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.79598086299e+09
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="smoke"} 6.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="smoke"} 1.7959808774626205e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="smoke"} 18.0
# HELP vllm:spec_decode_num_draft_tokens_created Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_created gauge
vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="smoke"} 1.7959808774626462e+09
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="smoke"} 7.0
# HELP vllm:spec_decode_num_accepted_tokens_created Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_created gauge
vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="smoke"} 1.7959808774626632e+09
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smoke",position="0"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smoke",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smoke",position="2"} 1.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_created Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_created gauge
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="smoke",position="0"} 1.7959808774626875e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="smoke",position="1"} 1.7959808774626944e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="smoke",position="2"} 1.7959808774627e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smoke"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smoke"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smoke"} 0.01
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried to...
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="smoke"} 400.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried ...
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="smoke"} 1.7959808774628959e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="smoke"} 192.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="smoke"} 1.795980877462907e+09
# HELP vllm:external_prefix_cache_queries_total External prefix cache queries from KV connect...
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="smoke"} 0.0
# HELP vllm:external_prefix_cache_queries_created External prefix cache queries from KV conne...
# TYPE vllm:external_prefix_cache_queries_created gauge
vllm:external_prefix_cache_queries_created{engine="0",model_name="smoke"} 1.7959808774629183e+09
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits from KV connector cro...
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="smoke"} 0.0
# HELP vllm:external_prefix_cache_hits_created External prefix cache hits from KV connector c...
# TYPE vllm:external_prefix_cache_hits_created gauge
vllm:external_prefix_cache_hits_created{engine="0",model_name="smoke"} 1.7959808774629292e+09
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="smoke"} 0.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="smoke"} 1.7959808774629662e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="smoke"} 0.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="smoke"} 1.7959808774629776e+09
# HELP vllm:prompt_tokens_cached_total Number of cached prompt tokens (local + external).
# TYPE vllm:prompt_tokens_cached_total counter
vllm:prompt_tokens_cached_total{engine="0",model_name="smoke"} 0.0
# HELP vllm:prompt_tokens_cached_created Number of cached prompt tokens (local + external).
# TYPE vllm:prompt_tokens_cached_created gauge
vllm:prompt_tokens_cached_created{engine="0",model_name="smoke"} 1.7959808774630198e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="smoke"} 0.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="smoke"} 1.7959808774630306e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="smoke"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="smoke"} 0.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="smoke"} 0.0
vllm:request_success_total{engine="0",finished_reason="error",model_name="smoke"} 0.0
vllm:request_success_total{engine="0",finished_reason="repetition",model_name="smoke"} 0.0
# HELP vllm:request_success_created Count of successfully processed requests.
# TYPE vllm:request_success_created gauge
vllm:request_success_created{engine="0",finished_reason="stop",model_name="smoke"} 1.7959808774630516e+09
vllm:request_success_created{engine="0",finished_reason="length",model_name="smoke"} 1.795980877463058e+09
vllm:request_success_created{engine="0",finished_reason="abort",model_name="smoke"} 1.7959808774630635e+09
vllm:request_success_created{engine="0",finished_reason="error",model_name="smoke"} 1.7959808774630692e+09
vllm:request_success_created{engine="0",finished_reason="repetition",model_name="smoke"} 1.795980877463076e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="smoke"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="smoke"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="smoke"} 0.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="smoke"} 0.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="smoke"} 0.0
"""  # noqa: E501


def test_parse_every_sample() -> None:
    samples = metrics.parse_prometheus(VLLM_0201_METRICS)
    assert len(samples) == sum(
        1 for line in VLLM_0201_METRICS.splitlines() if line and not line.startswith("#")
    )
    info = next(s for s in samples if s.name == "python_info")
    assert info.labels["implementation"] == "CPython"
    inf_bucket = next(s for s in samples if s.labels.get("le") == "+Inf")
    assert inf_bucket.name == "vllm:time_to_first_token_seconds_bucket"


def test_prefix_cache_counters_use_totals_not_created_or_external() -> None:
    counters = metrics.prefix_cache_counters(metrics.parse_prometheus(VLLM_0201_METRICS))
    assert counters == metrics.PrefixCacheCounters(queries=400.0, hits=192.0)
    earlier = metrics.PrefixCacheCounters(queries=200.0, hits=0.0)
    assert counters.minus(earlier) == metrics.PrefixCacheCounters(queries=200.0, hits=192.0)


def test_spec_decode_stats_and_acceptance_length() -> None:
    stats = metrics.spec_decode_stats(metrics.parse_prometheus(VLLM_0201_METRICS))
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (6, 18, 7)
    assert stats.accepted_per_position == [4.0, 2.0, 1.0]
    assert stats.acceptance_length == pytest.approx(1 + 7 / 6)
    assert stats.acceptance_rate == pytest.approx(7 / 18)
    assert stats.per_position_rate() == pytest.approx([4 / 6, 2 / 6, 1 / 6])
    assert stats.to_json()["acceptance_length"] == pytest.approx(2.1667, abs=1e-4)


def test_server_without_speculation_has_no_spec_stats() -> None:
    plain = "\n".join(line for line in VLLM_0201_METRICS.splitlines() if "spec_decode" not in line)
    samples = metrics.parse_prometheus(plain)
    assert metrics.spec_decode_stats(samples) is None
    assert metrics.prefix_cache_counters(samples) is not None


def test_counters_sum_over_engines_and_accept_bare_names() -> None:
    text = (
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 16.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 32.0\n'
        "vllm:prefix_cache_queries 100\n"
        'odd{path="a \\"quoted\\" \\\\ value"} NaN\n'
    )
    samples = metrics.parse_prometheus(text)
    assert metrics.counter_value(samples, "vllm:prefix_cache_hits") == 48.0
    assert metrics.counter_value(samples, "vllm:prefix_cache_queries") == 100.0
    assert samples[-1].labels["path"] == 'a "quoted" \\ value'
    assert math.isnan(samples[-1].value)
    assert metrics.counter_value(samples, "vllm:absent") is None


def test_garbage_is_refused() -> None:
    with pytest.raises(ValueError, match="line 2"):
        metrics.parse_prometheus("# HELP x y\n<html>not metrics</html>\n")


def test_no_drafts_means_no_acceptance_length() -> None:
    stats = metrics.SpecDecodeStats(0, 0, 0, [0.0, 0.0, 0.0])
    assert stats.acceptance_length is None
    assert stats.per_position_rate() == [0.0, 0.0, 0.0]


SERVER_LOG = """\
INFO 11-29 14:02:11 [api_server.py:1741] vLLM API server version 0.20.1
(EngineCore_DP0 pid=5120) INFO 11-29 14:02:30 [gpu_model_runner.py:4840] Using auxiliary layers from speculative config: (1, 3, 5)
(EngineCore_DP0 pid=5120) INFO 11-29 14:02:31 [cuda.py:367] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLEX_ATTENTION']
"""  # noqa: E501


def test_aux_layers_from_a_server_log(tmp_path) -> None:
    assert aux_layers_from_log(SERVER_LOG) == (1, 3, 5)
    fixed = SERVER_LOG.replace("(1, 3, 5)", "(2, 17, 32, 47, 62)")
    assert aux_layers_from_log(fixed) == (2, 17, 32, 47, 62)
    assert aux_layers_from_log("INFO no speculation here\n") is None
    log = tmp_path / "serve.log"
    log.write_text(fixed)
    assert aux_layers_from_log_file(log) == (2, 17, 32, 47, 62)
    assert aux_layers_from_log_file(tmp_path / "missing.log") is None


# The seed-shaped pair's servers on an H200 (64 hybrid layers, K = 15): the DFlash engine's
# recurrent state holds the verified positions too, so its blocks are larger.
HYBRID_SERVER_LOG = """\
(APIServer pid=3199) WARNING 12-01 18:58:18 [config.py:367] Mamba cache mode is set to 'align' for Qwen3_5ForConditionalGeneration by default when prefix caching is enabled
(EngineCore pid=3852) INFO 12-01 18:59:11 [interface.py:606] Setting attention block size to 480 tokens to ensure that attention page size is >= mamba page size.
(EngineCore pid=3852) INFO 12-01 18:59:11 [interface.py:630] Padding mamba page size by 1.27% to ensure that mamba page size and attention page size are exactly equal.
"""  # noqa: E501


def test_block_size_from_a_hybrid_server_log() -> None:
    assert block_size_from_log(HYBRID_SERVER_LOG) == 480
    assert block_size_from_log(HYBRID_SERVER_LOG.replace("480 tokens", "400 tokens")) == 400
    # An attention-only target keeps the configured size and says nothing.
    assert block_size_from_log(SERVER_LOG) is None
