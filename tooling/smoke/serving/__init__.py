"""Code that runs inside the SERVING interpreter (the GPU host's, with the vLLM under test, torch
and the reference ``dflash``), started by the runner as ``python -m tooling.smoke.serving.X``:
``engine_run`` (in-process vLLM: drafts, windows, the slot audit), ``distribution`` (one
engine's greedy tokens with top-k logprobs), ``reference`` (the reference ``dflash``
recomputation, its forward passes in ``reference_model``), ``tiny`` (seeded tiny models),
``preflight`` (which vLLM, the GPUs), ``child`` (their JSON in/out protocol, which
``tooling.trained.serving``'s children speak too), and two pure modules shared with the
toolchain: ``slotaudit`` (the audit's verdicts) and ``agreement`` (the reference comparison's
counts, which the runner sums over its shards).
"""
