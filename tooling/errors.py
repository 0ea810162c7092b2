"""The exception hierarchy and the one table that maps each failure to an exit code.

Every error a user can cause has its own class. Its ``str()`` is the one line
the CLI prints, so messages name the thing at fault (file, base, patch, hunk)
rather than the code path that noticed it.
"""

from __future__ import annotations


class ToolingError(Exception):
    """Base class: a failure the user can act on. Never a bug."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(ToolingError):
    """A pinned data file (bases.toml, series.toml) is missing or malformed."""

    exit_code = 3


class UnknownBaseError(ConfigError):
    """A base version that bases.toml does not pin."""

    exit_code = 4


class NetworkError(ToolingError):
    """The package index or a git remote could not be reached."""

    exit_code = 5


class IntegrityError(ToolingError):
    """A file's digest differs from the pinned one."""

    exit_code = 6


class ArchiveError(ToolingError):
    """An archive is truncated, corrupt or tries to escape its target folder."""

    exit_code = 7


class GitSourceError(ToolingError):
    """A git URL or ref does not exist, or a moving ref was refused."""

    exit_code = 8


class CacheMissError(ToolingError):
    """--offline and a needed file is not in the cache."""

    exit_code = 9


class SeriesError(ToolingError):
    """A patch file is missing, unreadable, or its sha256 differs from series.toml."""

    exit_code = 10


class PatchConflictError(ToolingError):
    """A patch neither applies nor is already present nor superseded."""

    exit_code = 11


class ProbeError(ToolingError):
    """A behavioural probe could not run at all (no interpreter, crash)."""

    exit_code = 12


class BuildError(ToolingError):
    """The wheel could not be built (refused mode, mismatched inputs, write failure)."""

    exit_code = 13


class WorkTreeError(BuildError):
    """A git work tree cannot be made (a full disk) or read back (a damaged series report).

    The patch stage's own error, with the build's exit code: the build makes most work
    trees, and stops on these.
    """


class ReleaseError(BuildError):
    """The release files cannot be made from what was given: a wheel this toolchain did not
    build, a file outside --dist, a status matrix it cannot use.

    The release stage's own error, with the build's exit code, which scripts that release
    a build already test for.
    """


class VerifyIntegrityError(ToolingError):
    """An installed file differs from RECORD."""

    exit_code = 14


class VerifyFixMissingError(ToolingError):
    """A required fix is not present in the installed vLLM."""

    exit_code = 15


class VllmNotFoundError(ToolingError):
    """No vLLM distribution in the environment that was asked about."""

    exit_code = 16


class SmokeError(ToolingError):
    """A GPU smoke check failed or could not run."""

    exit_code = 17


class SmokePairError(SmokeError):
    """The model pair given to the smoke is not one it can serve (a drafter without
    ``dflash_config``, a target that is not a causal LM, weights it cannot size)."""

    exit_code = 23


class SmokeCapacityError(SmokeError):
    """The model pair does not fit the GPUs the smoke can use, or a generated pair the disk."""

    exit_code = 24


class EnvironmentProblem(ToolingError):
    """A required tool (nvcc, uv, GPU) is missing on this machine."""

    exit_code = 18


class BundleError(ToolingError):
    """The offline bundle could not be resolved, downloaded, written or split."""

    exit_code = 19


class CacheWriteError(ToolingError):
    """The artifact cache cannot be written (full disk, read-only folder)."""

    exit_code = 20


class TrainSettingsError(ToolingError):
    """The training recipe's settings are invalid (an unknown --set key, a bad value)."""

    exit_code = 21


class TrainingError(ToolingError):
    """The training recipe failed one of its own checks, or gave no result."""

    exit_code = 22


class FuzzFindingError(ToolingError):
    """A fuzz campaign found a case that fails one of its oracles (saved as a case file)."""

    exit_code = 25


class FuzzCaseError(ToolingError):
    """A file given to replay or to the referee is not a saved fuzz case (unreadable, or a
    key of the wrong type)."""

    exit_code = 26


class FuzzNoEvidenceError(FuzzCaseError):
    """A case file given to ``tooling fuzz referee`` holds no token difference to settle: a
    finding of another oracle, or one saved before findings kept their evidence."""

    exit_code = 31


class LogFileError(ToolingError):
    """--log-file could not be written (a full disk): the command ran, its log is not whole."""

    exit_code = 27


class FuzzPairError(SmokePairError):
    """The pair given to ``tooling fuzz gpu`` is not one it can serve: no target/ or
    drafter/ folder, a config missing or invalid, weights it cannot size."""

    exit_code = 29


class FuzzNoGpuError(EnvironmentProblem):
    """The interpreter ``tooling fuzz gpu`` was given sees no GPU (no torch, or
    ``torch.cuda.is_available()`` false there)."""

    exit_code = 30


class RefereeInterpreterError(EnvironmentProblem):
    """The interpreter ``tooling fuzz referee`` was given cannot run the target in float32:
    it does not start, or cannot import torch or transformers."""

    exit_code = 32


class RefereeError(ToolingError):
    """``tooling fuzz referee`` could not compute the target's float32 logprobs: the target
    folder is not a model transformers loads, a token lies outside its vocabulary, or its
    child gave no answer."""

    exit_code = 33


class HostRefusal(ToolingError):
    """A GPU host step refuses before it does anything, as the host's state stands: a
    session already running, a process record that is none, a CALL past the last. Exit 2,
    the code the GPU host's scripts (``ci/gpu``) have always refused with."""

    exit_code = 2


class HostUsageError(HostRefusal):
    """An argument or setting a GPU host step does not take (an unknown step, a number that
    is not plain digits, a setting missing): named after the script it was given to, with
    that script's usage line when ``usage``."""

    def __init__(self, message: str, *, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage


class HostStepError(ToolingError):
    """A GPU host step failed: the parts do not join, the bundle does not install, a build
    or an install of an engine failed, no trained pair to carry."""

    exit_code = 28


def error_for_exit_code(code: int, message: str) -> ToolingError:
    """The error a child process of ours reported by its exit code (the trainer's, which
    runs in another interpreter), to raise again in this one."""
    pending: list[type[ToolingError]] = [ToolingError]
    while pending:
        cls = pending.pop()
        if cls.exit_code == code:
            return cls(message)
        pending += cls.__subclasses__()
    return ToolingError(message)


def exit_code_for(error: BaseException) -> int:
    """The process exit status for ``error``; 1 for anything unexpected."""
    if isinstance(error, ToolingError):
        return error.exit_code
    return 1
