"""What fix 11's probe asks of a release beyond its config: the grammar a structured-output
request gets when reasoning ends inside the drafts, and the pipeline-parallel check a V2
runner makes when it loads the target.

Both run the release's own code on the CPU: its structured-output manager with a real
xgrammar grammar over a small word-level tokenizer, and its load-time check on the target
model as vLLM builds it (on the meta device: no weights).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from . import _harness

#: Word-level vocabulary: reasoning tags and the characters a JSON object needs.
WORDS = ("<unk>", "<|endoftext|>", "<think>", "</think>", "{", "}", '"', ":", ",", " ", "a", "b")
VOCAB = {word: i for i, word in enumerate(WORDS)}
#: The reasoning parser asked with: 0.34.0's qwen3 parser imports mistral_common, which the
#: probe environment does not carry; deepseek_r1 ends reasoning on the same ``</think>``.
REASONING_PARSER = "deepseek_r1"
GRAMMAR_WAIT_S = 60.0


class CannotBuild(Exception):
    """The target model cannot be built on this machine to ask the release's check."""


def write_tokenizer(model_dir: Path) -> Any:
    """A tokenizer of ``WORDS`` saved beside the model's config, as a served model has one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|endoftext|>"
    )
    fast.save_pretrained(model_dir)
    return fast


def structured_output_config(config: Any) -> Any:
    """``config`` serving structured output (xgrammar) with the reasoning parser."""
    from vllm.config import StructuredOutputsConfig

    config.model_config.skip_tokenizer_init = False
    config.structured_outputs_config = StructuredOutputsConfig(
        backend="xgrammar", reasoning_parser=REASONING_PARSER
    )
    return config


def _allowed(row: Any) -> list[str]:
    return [w for w, i in VOCAB.items() if (int(row[i // 32]) >> (i % 32)) & 1]


def grammar_rows(config: Any, params: Any, prompt: list[str], drafts: list[str]) -> list[Any]:
    """The tokens the release's structured-output manager allows at each position of a
    verify step with ``drafts`` after ``prompt`` (None: any token), or raises TimeoutError
    when the grammar does not compile."""
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    manager = StructuredOutputManager(config)
    request = Request(
        request_id="so",
        prompt_token_ids=[VOCAB[w] for w in prompt],
        sampling_params=params,
        pooling_params=None,
    )
    manager.grammar_init(request)
    structured = request.structured_output_request
    ready = getattr(structured, "_check_grammar_completion", None)
    deadline = time.monotonic() + GRAMMAR_WAIT_S
    while not (ready() if ready else structured.grammar is not None):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the grammar did not compile in {GRAMMAR_WAIT_S:.0f} s")
        time.sleep(0.05)
    ids = [VOCAB[w] for w in drafts]
    bitmask = manager.grammar_bitmask({"so": request}, ["so"], {"so": ids})
    return [None if bool((row == -1).all()) else _allowed(row) for row in bitmask]


def load_check(config: Any) -> str | None:
    """The release's load-time check of pipeline parallelism for a DFlash drafter on the
    target of ``config``, as its V2 runner makes it once the model is built: None where it
    serves (the drafter's hidden states are relayed between stages), else its message.
    Raises LookupError where the release has no such check, CannotBuild where the model
    cannot be built here."""
    import importlib.util

    module = "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils"
    if importlib.util.find_spec(module) is None:
        raise LookupError("the release has no load-time check of pipeline parallelism")
    import importlib

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import current_platform

    check = importlib.import_module(module).verify_supports_aux_hidden_states_over_pp
    _harness.ensure_single_process_group(config)
    # The groups as this config makes them: an MoE target needs an expert-parallel one,
    # which a world made for another probe's config may lack.
    with set_current_vllm_config(config):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 1)
    # The probes' platform picks no MoE kernels; a CPU's serve a model that is never run.
    cpu_moe = classmethod(lambda cls: True)
    with (
        set_current_vllm_config(config),
        torch.device("meta"),
        _harness.replaced(type(current_platform), is_cpu=cpu_moe),
    ):
        try:
            model = initialize_model(vllm_config=config)
        except Exception as e:  # a release whose layers call a GPU kernel as they are made
            raise CannotBuild(f"{type(e).__name__}: {' '.join(str(e).split())[:120]}") from e
    try:
        check(model, config.speculative_config.method)
    except ValueError as e:
        return " ".join(str(e).split())
    return None
