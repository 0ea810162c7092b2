"""The float32 referee of the lossless oracle's token differences (``tooling fuzz referee``).

Both engines of a GPU fuzz pair compute in bf16, and two bf16 engines that batch differently
round differently: where plain's top-2 margin is small, DFlash's other token may be rounding,
not a defect. The referee settles each difference a finding keeps (``gpu_oracles.Evidence``)
with the target in float32 on the CPU: its logprobs at the difference, given the prompt and
the tokens both engines agreed on. ``rule`` is the verdict (margins in, ruling out, pure);
``referee`` runs the model in a child interpreter that has torch and transformers
(``serving.referee_model``, one JSON in, one out), as the campaign runs its engines.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import FuzzNoEvidenceError, RefereeError, RefereeInterpreterError
from ..paths import REPO_DIR
from ..procs import log_tail, run_child
from .gpu_case import read_gpu_case_file
from .gpu_oracles import Evidence

logger = logging.getLogger(__name__)

MODULE = "tooling.fuzzing.serving.referee_model"

NOISE = 2.0**-5
"""Plain's own noise: the most a top-2 logprob margin moved between the plain engine and
itself, batched otherwise (plain against plain), as first measured on the trained pair on
an H200. A float32 preference within it tells neither token from the other. A GPU session
rules with its own card's measurement where that is more (``host.fuzz.session_noise``)."""

#: How long the float32 child may take: a guard against a hang only, far above what loading
#: a target and its forward passes on the CPU need.
CHILD_TIMEOUT_S = 4 * 3600.0


class Ruling(enum.Enum):
    """What a difference is, by the target in float32."""

    DEFECT = "defect"
    """Float32 prefers plain's token over DFlash's by more than the noise."""
    ROUNDING = "rounding"
    """Float32 prefers DFlash's token, or the two are within the noise."""


def rule(float32_margin: float, noise: float = NOISE) -> Ruling:
    """The ruling on one difference: ``float32_margin`` is float32's logprob of plain's token
    less its logprob of DFlash's, ``noise`` the rounding two bf16 engines may differ by."""
    if not math.isfinite(float32_margin):
        raise ValueError(f"float32 margin {float32_margin}: not a number to rule on")
    return Ruling.DEFECT if float32_margin > noise else Ruling.ROUNDING


@dataclass(frozen=True)
class Entry:
    """One difference to settle: the finding file it was saved in, and its evidence."""

    file: Path
    evidence: Evidence

    @property
    def context(self) -> list[int]:
        """The tokens the target reads before the difference: the prompt, then the output
        both engines agreed on."""
        return [*self.evidence.prompt, *self.evidence.agreed]


@dataclass(frozen=True)
class Float32:
    """The target's float32 logprobs at one difference."""

    plain: float
    """Of plain's token."""
    dflash: float
    """Of DFlash's token."""
    best: int
    """Float32's own greedy token there."""

    @property
    def margin(self) -> float:
        """Float32's margin of plain's token over DFlash's (negative: it prefers DFlash's)."""
        return self.plain - self.dflash


@dataclass(frozen=True)
class Judged:
    """One difference settled."""

    entry: Entry
    float32: Float32
    ruling: Ruling

    def line(self) -> str:
        e = self.entry.evidence
        bf16 = "unknown" if e.plain_margin is None else f"{e.plain_margin:.6f}"
        excused = ", excused by the oracle" if e.excused else ""
        return (
            f"{self.entry.file.name} {e.request} position {e.position}: dflash {e.dflash}, "
            f"plain {e.plain}{excused}; plain's bf16 top-2 margin {bf16}, float32's margin of "
            f"plain's token over dflash's {self.float32.margin:+.6f} (float32's own "
            f"{self.float32.best}): {self.ruling.value}"
        )

    def to_json(self) -> dict[str, Any]:
        e = self.entry.evidence
        return {
            "file": str(self.entry.file),
            "request": e.request,
            "position": e.position,
            "dflash": e.dflash,
            "plain": e.plain,
            "excused": e.excused,
            "plain_margin": e.plain_margin,
            "float32_margin": self.float32.margin,
            "float32_logprobs": {"plain": self.float32.plain, "dflash": self.float32.dflash},
            "float32_best": self.float32.best,
            "ruling": self.ruling.value,
        }


@dataclass(frozen=True)
class RefereeReport:
    """Every difference of the findings given, settled against one target."""

    target: Path
    noise: float
    judged: tuple[Judged, ...]

    @property
    def defects(self) -> list[Judged]:
        return [j for j in self.judged if j.ruling is Ruling.DEFECT]

    def summary(self) -> str:
        files = len({j.entry.file for j in self.judged})
        return (
            f"{len(self.defects)} defect(s), {len(self.judged) - len(self.defects)} rounding, "
            f"of {len(self.judged)} difference(s) in {files} finding(s); noise {self.noise:g}, "
            f"target {self.target} in float32"
        )

    def text(self) -> str:
        return "\n".join([*(j.line() for j in self.judged), self.summary()])

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": not self.defects,
            "target": str(self.target),
            "noise": self.noise,
            "defects": len(self.defects),
            "differences": [j.to_json() for j in self.judged],
        }


def read_entries(paths: Sequence[Path]) -> list[Entry]:
    """Every evidence entry of the finding files ``paths``, in order. FuzzCaseError for a file
    that is not a case, FuzzNoEvidenceError for a case that holds no difference to settle."""
    entries: list[Entry] = []
    for path in paths:
        case_file = read_gpu_case_file(path)
        if not case_file.evidence:
            raise FuzzNoEvidenceError(
                f"{path}: a {case_file.kind} case with no evidence: no token difference to "
                "settle (a finding of another oracle, or saved before findings kept evidence)"
            )
        entries += [Entry(path, e) for e in case_file.evidence]
    return entries


def referee(
    entries: Sequence[Entry],
    target: Path,
    python: Path,
    env: Mapping[str, str],
    noise: float = NOISE,
    timeout_s: float = CHILD_TIMEOUT_S,
) -> RefereeReport:
    """Each of ``entries`` settled by ``target`` (a Hugging Face model folder) in float32 on
    the CPU, computed by ``python`` (which must import torch and transformers) in a child
    started with ``env``."""
    if not (target / "config.json").is_file():
        raise RefereeError(f"{target}: no config.json: not a Hugging Face model folder")
    request = {
        "target": str(target),
        "contexts": [
            {"ids": e.context, "tokens": [e.evidence.plain, e.evidence.dflash]} for e in entries
        ],
    }
    logger.debug("float32 referee: %d difference(s) on %s by %s", len(entries), target, python)
    answers = _run_model(request, python, env, timeout_s)
    if len(answers) != len(entries):
        raise RefereeError(f"{python}: {len(answers)} answers for {len(entries)} differences")
    judged = []
    for entry, answer in zip(entries, answers, strict=True):
        logprobs = answer["logprobs"]
        float32 = Float32(
            plain=float(logprobs[str(entry.evidence.plain)]),
            dflash=float(logprobs[str(entry.evidence.dflash)]),
            best=int(answer["best"]),
        )
        if not math.isfinite(float32.margin):
            raise RefereeError(f"{target}: float32 logprobs that are not numbers: {logprobs}")
        judged.append(Judged(entry, float32, rule(float32.margin, noise)))
    return RefereeReport(target, noise, tuple(judged))


def _run_model(
    request: dict[str, Any], python: Path, env: Mapping[str, str], timeout_s: float
) -> list[dict[str, Any]]:
    """The child's answer to ``request``, one per context; its failures as one-line errors."""
    with tempfile.TemporaryDirectory(prefix="tooling-referee-") as folder:
        work = Path(folder)
        in_file, out_file, log = work / "in.json", work / "out.json", work / "referee.log"
        in_file.write_text(json.dumps(request))
        cmd = [str(python), "-m", MODULE, str(in_file), str(out_file)]
        # The target is a local folder: nothing is to be fetched for it.
        child_env = {**env, "HF_HUB_OFFLINE": "1"}
        try:
            done = run_child(cmd, log=log, env=child_env, timeout_s=timeout_s, cwd=REPO_DIR)
        except OSError as e:
            raise RefereeInterpreterError(f"{python}: cannot start ({e.strerror or e})") from None
        if done.timed_out:
            raise RefereeError(f"{python}: no float32 answer within {timeout_s:g}s")
        try:
            data = json.loads(out_file.read_text())
        except (OSError, ValueError):
            tail = log_tail(log) or "no output"
            raise RefereeError(
                f"{python}: the float32 child wrote no answer (exit {done.returncode}): {tail}"
            ) from None
    if data.get("missing"):
        raise RefereeInterpreterError(
            f"{python}: cannot import {data['missing']}: give --python an interpreter with "
            "torch and transformers (the probe interpreter, `tooling probe-env`)"
        )
    if not data.get("ok"):
        raise RefereeError(f"{request['target']}: {data.get('error', 'the float32 child failed')}")
    answers: list[dict[str, Any]] = data["answers"]
    return answers
