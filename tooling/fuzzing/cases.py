"""A fuzz finding as a file: the case that failed, what failed, and where it was found.

The file is what ``tooling fuzz scheduler --replay`` runs again and what the regression
tests under ``tests/data/sched-fuzz/`` hold. Every value is checked against the case's own
types (``tooling/probes/_schedsim.py``'s ``Settings`` and ``Req``) before anything runs, and
a file that is not a case is refused naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import FuzzCaseError
from ..fsutil import atomic_write_text
from ..probes._schedsim import KINDS, OUTCOME_PASS, Req, Settings

logger = logging.getLogger(__name__)

FORMAT = "dflash-schedfuzz-case/1"
#: A case file is a few kilobytes; anything far larger is not one (and is not read whole).
MAX_BYTES = 1 << 20
#: Requests a case may hold: the fuzzer draws at most a few dozen.
MAX_REQUESTS = 1000


@dataclass(frozen=True)
class CaseFile:
    """A saved case: ``case`` (the fuzzer's JSON form), the outcome it gave, and on what."""

    case: dict[str, Any]
    kind: str
    """The oracle it failed (one of ``KINDS``), or "pass" for a case kept as a control."""
    detail: str = ""
    found_on: str = ""
    """The vLLM it was found on (a tree, or an interpreter's install)."""

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **dataclasses.asdict(self)}


def _int_triples(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(r, (list, tuple)) and len(r) == 3 and all(type(x) is int for x in r)
        for r in value
    )


def check_fields(cls: type, data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise FuzzCaseError(f"{where}: expected a table of {cls.__name__} values")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(data) - known)
    if extra:
        raise FuzzCaseError(f"{where}: unknown key {extra[0]!r}")
    for name in known:
        if name not in data:
            required = next(f for f in dataclasses.fields(cls) if f.name == name)
            if required.default is dataclasses.MISSING:
                raise FuzzCaseError(f"{where}: missing key {name!r}")
            continue
        value, hint = data[name], hints[name]
        if typing.get_origin(hint) is tuple:
            # A tuple of whole-number triples, which JSON writes as lists.
            if not _int_triples(value):
                raise FuzzCaseError(f"{where}: {name!r} must be a list of [int, int, int]")
            continue
        allowed = typing.get_args(hint) or (hint,)
        ok = any(
            (value is None and t is type(None))
            or (t is float and type(value) in (int, float))
            or (t is not type(None) and type(value) is t)
            for t in allowed
        )
        if not ok:
            raise FuzzCaseError(f"{where}: {name!r} must be {hint}, not {value!r}")


def validate_case(data: Any, where: str) -> dict[str, Any]:
    """``data`` checked to be a case in the fuzzer's JSON form; returned as it is."""
    if not isinstance(data, dict) or set(data) - {"settings", "requests", "seed"}:
        raise FuzzCaseError(f"{where}: a case holds 'settings', 'requests' and 'seed'")
    check_fields(Settings, data.get("settings"), f"{where}: settings")
    requests = data.get("requests")
    if not isinstance(requests, list) or len(requests) > MAX_REQUESTS:
        raise FuzzCaseError(f"{where}: 'requests' must be a list of at most {MAX_REQUESTS}")
    for i, req in enumerate(requests):
        check_fields(Req, req, f"{where}: requests[{i}]")
    if type(data.get("seed", 0)) is not int:
        raise FuzzCaseError(f"{where}: 'seed' must be an integer")
    return data


def load_case_json(
    path: Path, fmt: str, kinds: tuple[str, ...], max_bytes: int = MAX_BYTES
) -> dict[str, Any]:
    """The JSON table saved in ``path`` whose "format" is ``fmt``, its "kind" one of
    ``kinds`` or "pass" and its "detail" and "found_on" strings; FuzzCaseError naming the
    file (and the key) when it cannot be read, is larger than ``max_bytes``, is not JSON or
    is none of these."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise FuzzCaseError(f"{path}: cannot read: {e.strerror}") from None
    if len(raw) > max_bytes:
        raise FuzzCaseError(f"{path}: larger than {max_bytes} bytes: not a fuzz case")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FuzzCaseError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise FuzzCaseError(f"{path}: 'format' is not {fmt!r}: not a fuzz case")
    if data.get("kind") not in (*kinds, OUTCOME_PASS):
        raise FuzzCaseError(f"{path}: 'kind' must be one of {', '.join((*kinds, 'pass'))}")
    for key in ("detail", "found_on"):
        if not isinstance(data.get(key, ""), str):
            raise FuzzCaseError(f"{path}: {key!r} must be a string")
    return data


def read_case_file(path: Path) -> CaseFile:
    """The case saved in ``path``; FuzzCaseError naming the file and key when it is none."""
    data = load_case_json(path, FORMAT, KINDS)
    return CaseFile(
        case=validate_case(data.get("case"), f"{path}: case"),
        kind=data["kind"],
        detail=data.get("detail", ""),
        found_on=data.get("found_on", ""),
    )


def write_case_file(path: Path, case_file: CaseFile) -> None:
    logger.debug("case (%s) written to %s", case_file.kind, path)
    atomic_write_text(path, json.dumps(case_file.to_json(), indent=1) + "\n")
