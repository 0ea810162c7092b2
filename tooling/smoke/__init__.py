"""``tooling smoke``: serve a target with a DFlash drafter on a GPU and check every fix at run time.

The public API (the Click command is a thin layer over it):

- :class:`SmokeConfig` (with :class:`EngineSettings`, :class:`Timeouts`): what to run.
- :func:`run_smoke` -> :class:`SmokeReport`: run it; ``report.passed``,
  ``report.to_json()``, ``report.summary_line()``; :func:`format_table` for people.
- :func:`describe_plan` -> :class:`SmokePlan`: what a run would start, where and when (a dry
  run); ``run_smoke`` executes that same plan (``plan.plan_smoke``, pure).
- ``request.smoke_run_requested``: what the command runs for a smoke (the wheel under test
  installed first, then a dry run or the run); the trained pairs' programs are
  ``tooling.trained``'s.
- :func:`build_serve_command`, :class:`ServeOptions`: the ``vllm serve`` argv.

Modules (the toolchain's side): ``config`` (settings, prompts, drafter expectations), ``pair``
(the pair's figures and refusals; the one reader of a model's config.json), ``plan/`` (the
plan: its data, GPU memory, deadlines, the reference's placement, ``plan_smoke``,
``describe_plan``), ``preflight`` (vLLM and the GPUs, before anything starts), ``runner`` (the
plan executed wave by wave, with ``run_state`` and ``run_steps``), ``server`` and ``client``
(``vllm serve`` and its HTTP API; their process groups always stop, through
``tooling.procs``), ``observe`` (what a server is asked), ``load`` (the concurrent bursts),
``metrics`` (``/metrics`` parsing), ``logscan`` (the aux-layer log line), ``checks/`` (pure
verdicts), ``verdicts`` (the run's checks from its observations), ``report`` (table, JSON,
plot), ``distribution`` (the first-token comparison), ``site`` (the wheel under test
installed), ``reference_pool`` (the reference comparison's children: started early, work
handed out late). ``serving/`` runs inside the serving interpreter: ``engine_run``
(in-process vLLM, GPU), ``distribution`` (one engine's first tokens), ``reference`` and
``reference_model`` (the reference ``dflash`` recomputation), ``tiny`` (seeded tiny models),
``preflight``.
"""

from __future__ import annotations

from .checks import CheckResult
from .config import EngineSettings, GpuFacts, SmokeConfig, Timeouts
from .plan import SmokePlan, describe_plan
from .report import SmokeReport, format_table
from .runner import run_smoke
from .server import ServeOptions, build_serve_command

__all__ = [
    "CheckResult",
    "EngineSettings",
    "GpuFacts",
    "ServeOptions",
    "SmokeConfig",
    "SmokePlan",
    "SmokeReport",
    "Timeouts",
    "build_serve_command",
    "describe_plan",
    "format_table",
    "run_smoke",
]
