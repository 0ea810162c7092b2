"""The float32 referee's model side: the target's logprobs at each token difference, in
float32 on the CPU.

Runs as ``python -m tooling.fuzzing.serving.referee_model IN.json OUT.json`` in an
interpreter with torch and transformers (``tooling fuzz referee --python``; the probe
interpreter has both), and speaks the smoke children's JSON in/out
(``smoke.serving.child``). IN holds the target folder and, per difference, the context (the
prompt and the output both engines agreed on) and the two tokens; OUT, per difference, their
float32 logprobs after that context and the target's own greedy token there. An interpreter
without torch or transformers answers which it lacks (``missing``), not a traceback.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from ...smoke.serving.child import serve

logger = logging.getLogger(__name__)


def judge(request: dict[str, Any]) -> dict[str, Any]:
    """The float32 logprobs of each context's tokens, with the target's greedy token."""
    try:
        import torch
        import transformers  # noqa: F401  (asked first: its absence is an answer)
    except ImportError as e:
        return {"missing": f"{e.name or 'torch or transformers'} ({e})"}
    from ...smoke.serving.reference_model import load_target

    model = load_target(request["target"], "cpu", "float32")
    answers = []
    for context in request["contexts"]:
        ids = torch.tensor([context["ids"]], dtype=torch.long)
        with torch.inference_mode():
            logits = model(ids, use_cache=False).logits[0, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        outside = [t for t in context["tokens"] if not 0 <= t < logprobs.numel()]
        if outside:
            raise ValueError(
                f"token {outside[0]} outside the target's vocabulary of {logprobs.numel()}"
            )
        best = int(torch.argmax(logprobs))
        answers.append(
            {
                "logprobs": {str(t): float(logprobs[t]) for t in context["tokens"]},
                "best": best,
            }
        )
    logger.debug("float32 logprobs at %d difference(s)", len(answers))
    return {"answers": answers, "torch": torch.__version__}


def main(argv: list[str]) -> int:
    return serve(Path(argv[0]), Path(argv[1]), judge)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
