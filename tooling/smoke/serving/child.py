"""The contract of the smoke's child processes: read a JSON request, write a JSON result.

A child (``engine_run``, ``reference``, ``tooling.trained.serving.acceptance``) runs in another
interpreter, often beside a vLLM the parent must not import. Whatever
happens, it writes ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``
so the parent always has a verdict to read.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def serve(in_path: Path, out_path: Path, work: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """Run ``work`` on the request in ``in_path``; write its result to ``out_path``."""
    request = json.loads(in_path.read_text(encoding="utf-8"))
    try:
        result: dict[str, Any] = {"ok": True, **work(request)}
    except Exception as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        result = {
            "ok": False,
            "error": f"{type(e).__name__}: {message}"[:400],
            "traceback": traceback.format_exc()[-4000:],
        }
    out_path.write_text(json.dumps(result) + "\n", encoding="utf-8")
    logger.debug("wrote %s (ok: %s)", out_path, result["ok"])
    return 0 if result["ok"] else 1


def exit_now(code: int) -> None:
    """Leave at once: vLLM's engine threads can keep the interpreter alive after the
    result is written, and the parent would wait for its time limit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
