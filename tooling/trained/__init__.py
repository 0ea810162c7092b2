"""``tooling smoke --trained`` and ``--trained-hybrid``: the recipe's trained pairs on vLLM engines
(stage: after ``tooling.smoke``, whose serving children and comparisons it reuses).

Modules: ``request`` (the two programs as the command runs them), ``measure`` (the trained pair
trained or read from the cache, then measured; ``python -m tooling.trained.measure run-call``
for one call on a host whose commands are bounded in time), ``acceptance`` (the acceptance
table across engines), ``hybrid_plan`` (what each engine of ``--trained-hybrid`` runs),
``hybrid_verdicts`` (its pure verdicts), ``hybrid`` (its report; ``python -m
tooling.trained.hybrid plan|report``), ``hybrid_proof`` (the hybrid defects' proof on a
seed-shaped pair, ``ci/gpu/hybrid-proof.sh``). ``serving/`` runs inside the serving
interpreter: ``acceptance`` (one engine's acceptance on the trained pair) and ``trained_run``
(one engine of ``--trained-hybrid``).
"""
