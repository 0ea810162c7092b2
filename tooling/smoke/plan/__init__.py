"""The smoke's plan: which engines, where, in what order, with which deadlines, checks and prompts.

``plan_smoke`` (``make``) is pure: the run's settings, the pair's figures (``pair.PairFacts``)
and the GPUs (``config.GpuFacts``) in, one ``SmokePlan`` (``model``) out. ``--dry-run`` prints
that object (``describe.describe_plan``) and the runner executes that same object, so the two
cannot drift. ``memory`` sizes and places the engines on the GPUs, ``reference`` places the
reference comparison, ``deadlines`` holds the time limits and the run's overall ``Deadline``.
"""

from __future__ import annotations

from .deadlines import Deadline, Deadlines, Limit
from .describe import check_models_disk, describe_plan, pair_facts, pair_to_run
from .make import ModelsDraw, models_draw, plan_smoke, serve_options
from .memory import kv_cache_bytes
from .model import TINY_MODULE, Layout, Mode, ReferencePlan, Role, SmokePlan, Step, render

__all__ = [
    "TINY_MODULE",
    "Deadline",
    "Deadlines",
    "Layout",
    "Limit",
    "Mode",
    "ModelsDraw",
    "ReferencePlan",
    "Role",
    "SmokePlan",
    "Step",
    "check_models_disk",
    "describe_plan",
    "kv_cache_bytes",
    "models_draw",
    "pair_facts",
    "pair_to_run",
    "plan_smoke",
    "render",
    "serve_options",
]
