"""Code that runs inside the SERVING interpreter for the trained pairs, started as ``python -m
tooling.trained.serving.X``: ``acceptance`` (one engine's acceptance on the trained pair) and
``trained_run`` (one engine of ``--trained-hybrid``); both speak the smoke's child protocol
(``tooling.smoke.serving.child``).
"""
