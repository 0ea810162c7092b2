"""``python -m tooling.trainer train [options]``: the recipe in this interpreter.

A thin entry over ``recipe.train``, kept because the recipe runs where the
toolchain's own dependencies (Click, GitPython) may be missing: the child that
``api.train_in`` (``tooling train``, ``tooling smoke --trained``) starts, and
the GPU host's ``ci/gpu/train-background.sh``, whose interpreter trains with
the host's own transformers. Errors are tooling's: one line, its exit code.
With ``--outcome FILE`` the result (or the error) goes to that file for
``train_in``; without, the pair is printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

from ..entry import answer, entry_logging
from ..errors import ToolingError
from .api import TrainRequest, write_outcome
from .common import Log, StopRequest
from .recipe import train

logger = logging.getLogger(__name__)


def _request(argv: list[str]) -> tuple[TrainRequest, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m tooling.trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run the recipe (reuses a finished run)")
    p.add_argument("--preset", default="full")
    p.add_argument("--arch")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--cache-dir", type=Path)
    p.add_argument("--out-dir", type=Path)
    p.add_argument("--device")
    p.add_argument("--export", type=Path)
    p.add_argument("--force", action="store_true")
    p.add_argument("--outcome", type=Path, help="write the result or the error here (JSON)")
    args = parser.parse_args(argv)
    request = TrainRequest(
        preset=args.preset,
        arch=args.arch,
        overrides=tuple(args.overrides),
        cache_dir=args.cache_dir,
        out_dir=args.out_dir,
        device=args.device,
        export=args.export,
        force=args.force,
    )
    return request, args.outcome


def _stop(signum: int, _frame: object) -> None:
    # A second signal while the run folder is removed ends the process at once.
    signal.signal(signum, signal.SIG_DFL)
    StopRequest.signum = signum
    raise KeyboardInterrupt(signum)


def main(argv: list[str]) -> int:
    request, outcome = _request(argv)
    with entry_logging():
        return _train(request, outcome)


def _train(request: TrainRequest, outcome: Path | None) -> int:
    # Stopped from outside (``train_in`` stopping its child, a GPU host's kill), the run
    # folder of weights being written is removed, as on any failure.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop)
    try:
        pair = train(request, Log())
    except KeyboardInterrupt as e:
        stopped = signal.Signals(
            e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
        )
        # Under ``train_in`` (an outcome file) the parent stopped this child and says so
        # itself, on the same stderr: one line, not two.
        if outcome is None:
            logger.error("error: interrupted (%s)", stopped.name)
        return 128 + stopped
    except ToolingError as e:
        if outcome is not None:
            write_outcome(outcome, e)  # train_in reports it, as its own error
        else:
            logger.error("error: %s", e)
        return e.exit_code
    if outcome is not None:
        write_outcome(outcome, pair)
        logger.debug("wrote the pair to %s", outcome)
    else:
        answer(json.dumps(pair.to_json(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
