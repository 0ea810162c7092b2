"""``tooling host``: the GPU host's steps, which ``ci/gpu``'s scripts call.

On the host (an offline NVIDIA machine with the host's ``python3``, torch and triton, but no
vLLM): ``setup`` joins the carried parts, installs the bundle into ``$WORK/site`` and builds
every engine (stock, patched, the series' ablations); ``smoke``, ``smoke-all``,
``smoke-pair``, ``acceptance``, ``proof``, ``trained`` and ``fuzz`` run the smokes, the
hybrid proof, the trained pair's calls and the GPU fuzzer; ``session`` runs a whole
session's steps in the background and brings back what they wrote. Here, on the build
machine: ``make-parts`` and ``pair-parts``.

Modules: ``layout`` (the host's folders, a child's environment, how a child runs, the checks
of what a step is given), ``setup``, ``variants`` (the production smoke's variants as data),
``smoke``, ``proof``, ``trained``, ``fuzz``, ``session``, ``parts``. The host process
imports only what the host's python3 has before the bundle is installed
(tests/test_host_python.py); vLLM, torch and the smoke's serving side run in children with
a site of their own on PYTHONPATH.
"""
