"""Stage 6, fuzz: seeded campaigns over the open space of serving settings and workloads.

``scheduler``: vLLM's real Scheduler on the CPU, in the probe interpreter (the fuzzer itself
is ``tooling/probes/_schedfuzz.py``); ``cases``: the saved-case format a finding is kept in
and replayed from.
"""
