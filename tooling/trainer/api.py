"""The recipe as one call: a request in, the trained pair out, the work in another interpreter.

The recipe needs torch, transformers and the reference ``dflash`` package, and
holds the GPU while it trains: the toolchain's own interpreter has none of
them, and the smoke suite starts vLLM engines on that GPU afterwards, which
profile its free memory. So ``train_in`` runs the recipe in a child
interpreter (``python -m tooling.trainer``, the thin entry over
``recipe.train``) and reads its outcome back from a file the child writes:
these dataclasses on both sides, and a failure there is the same
``ToolingError`` here. Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import (
    EnvironmentProblem,
    ToolingError,
    TrainingError,
    TrainSettingsError,
    error_for_exit_code,
)
from ..fsutil import check_creatable, read_bounded, run_scratch
from ..procs import started
from ..schema import Doc
from .config import ARCH_PRESETS, PRESETS, RecipeConfig, apply_overrides

logger = logging.getLogger(__name__)

#: What a run folder holds (``common.RunPaths``).
RUN_ENTRIES = frozenset(
    {
        "target",
        "drafter",
        "prompts.json",
        "reference.json",
        "summary.json",
        "recipe.json",
        "train.log",
    }
)

#: The ``tooling`` package, which the child imports the trainer from.
_PACKAGE = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class TrainRequest:
    """What to train and where: the settings, the cache, and where to copy the small results."""

    preset: str = "full"
    arch: str | None = None
    """``qwen3`` or ``hybrid``: picks that architecture's preset of the size ``preset`` names."""
    overrides: tuple[str, ...] = ()
    """``KEY=VALUE`` settings over the preset (tuples as comma lists)."""
    cache_dir: Path | None = None
    """The cache root (run folders go to ``<cache>/trained/<digest>``); None: the default."""
    out_dir: Path | None = None
    """This exact run folder instead."""
    device: str | None = None
    """A torch device (None: cuda:0, else the CPU)."""
    export: Path | None = None
    """Also copy summary, prompts, reference and log here."""
    force: bool = False
    """Retrain even when a finished run folder exists."""

    def preset_name(self) -> str:
        """The preset ``preset`` and ``arch`` name together; a bad pair is a TrainSettingsError."""
        if self.arch is None:
            name = self.preset
        elif self.arch not in ARCH_PRESETS:
            raise TrainSettingsError(
                f"--arch {self.arch!r}: not one of {', '.join(sorted(ARCH_PRESETS))}"
            )
        elif self.preset not in ARCH_PRESETS[self.arch]:
            sizes = ", ".join(sorted(ARCH_PRESETS[self.arch]))
            raise TrainSettingsError(f"--preset {self.preset!r} with --arch: not one of {sizes}")
        else:
            name = ARCH_PRESETS[self.arch][self.preset]
        if name not in PRESETS:
            raise TrainSettingsError(f"--preset {name!r}: not one of {', '.join(sorted(PRESETS))}")
        return name

    def check_out_dir(self) -> None:
        """``out_dir`` is the user's folder, which a run replaces whole (with ``force``, or
        when it holds another recipe's pair): one holding anything but a finished run, a run's
        files with its ``summary.json`` (written last), is refused before any work, so that
        nothing of the user's is replaced."""
        if self.out_dir is None:
            return
        # A name too long for its temp sibling, a file in its way or a folder nothing can be
        # made in: each was a traceback in the child.
        check_creatable(self.out_dir, "--out-dir", TrainSettingsError)
        if not self.out_dir.is_dir():
            return
        names = sorted(p.name for p in self.out_dir.iterdir())
        foreign = [n for n in names if n not in RUN_ENTRIES]
        if foreign:
            raise TrainSettingsError(
                f"--out-dir {self.out_dir}: holds {_listed(foreign)}, which no run writes, and "
                "a run replaces the folder whole: give a new or empty folder"
            )
        run = self.out_dir
        finished = (run / "target").is_dir() and (run / "drafter").is_dir()
        if names and not (finished and (run / "summary.json").is_file()):
            raise TrainSettingsError(
                f"--out-dir {self.out_dir}: holds {_listed(names)} but no finished run (a run "
                "writes its summary.json last), and a run replaces the folder whole: give a "
                "new or empty folder"
            )
        if names:
            read_summary(run / "summary.json", TrainSettingsError)

    def config(self) -> RecipeConfig:
        """The checked settings; a bad preset or override is one TrainSettingsError line."""
        name = self.preset_name()
        try:
            cfg = apply_overrides(PRESETS[name], list(self.overrides))
            cfg.validate()
        except ValueError as e:
            raise TrainSettingsError(f"recipe settings: {e}") from None
        return cfg

    def argv(self) -> list[str]:
        """The child's command line for this request (``python -m tooling.trainer ARGV``)."""
        args = ["train", "--preset", self.preset]
        if self.arch is not None:
            args += ["--arch", self.arch]
        for pair in self.overrides:
            args += ["--set", pair]
        for flag, value in (
            ("--cache-dir", self.cache_dir),
            ("--out-dir", self.out_dir),
            ("--device", self.device),
            ("--export", self.export),
        ):
            if value is not None:
                args += [flag, str(value)]
        return [*args, "--force"] if self.force else args


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


#: The largest summary.json read: a run's is a few kB.
SUMMARY_LIMIT = 1 << 20


def read_summary(path: Path, error: type[ToolingError] = TrainingError) -> dict[str, Any]:
    """A finished run's ``summary.json``, with the figures :class:`TrainedPair` reads checked
    against their types: anything else is ``error``, one line naming the file and the key."""
    raw = read_bounded(path, SUMMARY_LIMIT, "a run's summary", error)
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise error(f"{path}: not a run's summary (not JSON: {e})") from None
    doc = Doc(str(path), error)
    doc.text(data, "output_dir")
    doc.text(data, "recipe_digest")
    doc.number(data, "wall_s", None)
    doc.inner(": target").number(doc.table(data, "target"), "heldout_loss")
    reference = doc.inner(": reference")
    table = doc.table(data, "reference")
    reference.number(table, "mean_acceptance_length")
    reference.numbers(table, "acceptance_per_position")
    return dict(data)


def finished_summary(path: Path, *, users: bool) -> dict[str, Any] | None:
    """A finished run's summary at ``path``: a damaged one is the error of the user's folder
    (``users``: --out-dir) and, in the cache's own folder, a run to make again (None)."""
    try:
        return read_summary(path, TrainSettingsError)
    except TrainSettingsError:
        if users:
            raise
        return None


@dataclass(frozen=True)
class TrainedPair:
    """A finished run folder: the target and drafter vLLM loads, and the reference figures."""

    output_dir: Path
    recipe_digest: str
    cached: bool
    """Reused a finished run folder rather than training."""
    heldout_loss: float
    mean_acceptance_length: float
    """The reference ``dflash`` package's, on the held-out prompts."""
    acceptance_per_position: tuple[float, ...]
    wall_s: float | None
    """Seconds the training took (None: not recorded)."""

    @property
    def summary(self) -> Path:
        return self.output_dir / "summary.json"

    @classmethod
    def from_summary(cls, summary: dict[str, Any], *, cached: bool) -> TrainedPair:
        reference = summary["reference"]
        return cls(
            output_dir=Path(summary["output_dir"]),
            recipe_digest=summary["recipe_digest"],
            cached=cached,
            heldout_loss=summary["target"]["heldout_loss"],
            mean_acceptance_length=reference["mean_acceptance_length"],
            acceptance_per_position=tuple(reference["acceptance_per_position"]),
            wall_s=summary.get("wall_s"),
        )

    def describe(self) -> str:
        """Two lines for a person: where, how, and the reference figures."""
        how = "reused" if self.cached else f"trained in {self.wall_s or 0:.1f} s"
        per_position = ", ".join(f"{a:.3f}" for a in self.acceptance_per_position)
        return (
            f"{self.output_dir} ({how}; recipe {self.recipe_digest})\n"
            f"held-out loss {self.heldout_loss:.4f}; reference mean acceptance length "
            f"{self.mean_acceptance_length:.3f} (per position {per_position})"
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(output_dir=str(self.output_dir), summary=str(self.summary))
        data["acceptance_per_position"] = list(self.acceptance_per_position)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainedPair:
        values = {k: v for k, v in data.items() if k != "summary"}
        values["output_dir"] = Path(values["output_dir"])
        values["acceptance_per_position"] = tuple(values["acceptance_per_position"])
        return cls(**values)


def write_outcome(path: Path, outcome: TrainedPair | ToolingError) -> None:
    """The child's answer for ``train_in``: the pair, or the error (one line, its exit code)."""
    data = (
        {"pair": outcome.to_json()}
        if isinstance(outcome, TrainedPair)
        else {"error": str(outcome), "exit_code": outcome.exit_code}
    )
    path.write_text(json.dumps(data), encoding="utf-8")


def train_in(python: Path, request: TrainRequest) -> TrainedPair:
    """Run the recipe in ``python`` (which must import torch, transformers, tokenizers and
    dflash) and return the pair; it reuses a finished run folder unless ``force``.

    The child's log goes to this process's stderr as it runs (minutes on a GPU).
    """
    request.config()  # bad settings are this process's error, before a child starts
    request.check_out_dir()
    with run_scratch("train") as tmp:
        # The child imports this very package through a link, and nothing else of this
        # interpreter's: ``python`` may be any interpreter with torch.
        (tmp / "tooling").symlink_to(_PACKAGE, target_is_directory=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp), env.get("PYTHONPATH", "")) if p)
        # Its temp files (torch's compile caches, torchinductor_<user>, among them) go in
        # this run's folder, which goes on any exit.
        scratch = tmp / "tmp"
        scratch.mkdir()
        env["TMPDIR"] = str(scratch)
        outcome_file = tmp / "outcome.json"
        command = [str(python), "-m", "tooling.trainer", *request.argv()]
        logger.debug("train in %s (its log follows on stderr)", python)
        try:
            with started(
                [*command, "--outcome", str(outcome_file)],
                # Stopped, the child removes its run folder (weights) before it exits.
                grace_s=30.0,
                stdin=subprocess.DEVNULL,
                # To this process's stderr (fd 2), as the child's log: stdout is our result.
                stdout=2,
                env=env,
            ) as child:
                returncode = child.wait()
        except OSError as e:
            raise EnvironmentProblem(f"cannot start {python}: {e.strerror or e}") from None
        if not outcome_file.is_file():
            raise TrainingError(
                f"the training recipe in {python} exited {returncode} without a result "
                "(its output is above)"
            )
        outcome = json.loads(outcome_file.read_text(encoding="utf-8"))
    if "pair" not in outcome:
        raise error_for_exit_code(outcome["exit_code"], outcome["error"])
    return TrainedPair.from_json(outcome["pair"])
