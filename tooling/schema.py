"""Values read from a file (a ledger, a JSON document a run or a child wrote, a model's
config) checked against their type before they are used.

A value of the wrong type is never coerced: ``bool("no")`` is true and ``tuple("id")`` is
``("i", "d")``, so a ledger saying ``touches_compiled_code = "no"`` or ``requires = "id"``
would be read as something it does not say. Instead it is the reader's own error (each
caller passes its class, so the exit code is that stage's), one line naming the file, the
key and the value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, NoReturn, TypeVar

from .errors import ToolingError

T = TypeVar("T")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class _Missing:
    """The default of a key that must be there."""


MISSING: Any = _Missing()


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_whole(value) or isinstance(value, float)) and math.isfinite(value)


@dataclass(frozen=True)
class Doc:
    """Where values are read from (``where``: the file, and the table in it) and the error a
    wrong one is."""

    where: str
    error: type[ToolingError]

    def inner(self, suffix: str) -> Doc:
        """The same file, a table further in (``suffix`` names it: ``: patch #3``)."""
        return Doc(f"{self.where}{suffix}", self.error)

    def fail(self, why: str) -> NoReturn:
        raise self.error(f"{self.where}: {why}")

    def mapping(self, data: Any) -> Mapping[str, Any]:
        """``data`` itself, which must be a table (a JSON object)."""
        if not isinstance(data, Mapping):
            self.fail(f"is {_shown(data)}, not a table of keys")
        return data

    def _value(self, data: Any, key: str, default: Any) -> Any:
        table = self.mapping(data)
        if key in table:
            return table[key]
        if default is MISSING:
            self.fail(f"missing key {key!r}")
        return default

    def _typed(
        self, data: Any, key: str, default: Any, ok: Callable[[Any], bool], kind: str
    ) -> Any:
        value = self._value(data, key, default)
        if value is default and default is not MISSING:
            return value
        if not ok(value):
            self.fail(f"{key} {_shown(value)} is not {kind}")
        return value

    def text(self, data: Any, key: str, default: Any = MISSING) -> Any:
        return self._typed(data, key, default, lambda v: isinstance(v, str), "a string")

    def flag(self, data: Any, key: str, default: Any = MISSING) -> Any:
        return self._typed(data, key, default, lambda v: isinstance(v, bool), "true or false")

    def whole(
        self,
        data: Any,
        key: str,
        default: Any = MISSING,
        *,
        least: int | None = None,
        most: int | None = None,
    ) -> Any:
        """A whole number (true and false are not), within ``least`` and ``most``."""
        value = self._typed(data, key, default, _is_whole, "a whole number")
        if value is default and default is not MISSING:
            return value
        if least is not None and value < least:
            self.fail(f"{key} {value} is below {least}")
        if most is not None and value > most:
            self.fail(f"{key} {value} is above {most}")
        return value

    def number(self, data: Any, key: str, default: Any = MISSING) -> Any:
        """A finite number, whole or not (true and false are not)."""
        return self._typed(data, key, default, _is_number, "a finite number")

    def _list(
        self, data: Any, key: str, default: Any, item: Callable[[Any], bool], name: str
    ) -> Any:
        """A list whose every item passes ``item``, as a tuple."""
        value = self._typed(
            data, key, default, lambda v: isinstance(v, list) and all(item(x) for x in v), name
        )
        return tuple(value) if isinstance(value, list) else value

    def texts(self, data: Any, key: str, default: Any = MISSING) -> Any:
        """A list of strings, as a tuple."""
        return self._list(data, key, default, lambda x: isinstance(x, str), "a list of strings")

    def numbers(self, data: Any, key: str, default: Any = MISSING) -> Any:
        """A list of finite numbers, as a tuple."""
        return self._list(data, key, default, _is_number, "a list of numbers")

    def wholes(self, data: Any, key: str, default: Any = MISSING) -> Any:
        """A list of whole numbers, as a tuple."""
        return self._list(data, key, default, _is_whole, "a list of whole numbers")

    def table(self, data: Any, key: str, default: Any = MISSING) -> Any:
        return self._typed(data, key, default, lambda v: isinstance(v, Mapping), "a table")

    def tables(self, data: Any, key: str, default: Any = MISSING) -> Any:
        """A list of tables (TOML's ``[[key]]``, a JSON list of objects)."""
        return self._typed(
            data,
            key,
            default,
            lambda v: isinstance(v, list) and all(isinstance(x, Mapping) for x in v),
            "a list of tables",
        )

    def only_keys(self, data: Any, known: frozenset[str]) -> None:
        """Fail on a key ``data`` holds that is none of ``known`` (a misspelt setting would
        otherwise be ignored)."""
        unknown = sorted(set(self.mapping(data)) - known)
        if unknown:
            self.fail(f"unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")

    def file_name(self, data: Any, key: str, where: str = "") -> str:
        """A file's bare name (no folder, no ``..``): a path would reach outside ``where``."""
        name: str = self.text(data, key)
        if PurePath(name).name != name or name in ("", ".", ".."):
            self.fail(f"{key} {name!r} is not a file name{where}")
        return name

    def sha256(self, data: Any, key: str) -> str:
        """A sha256 digest as 64 hex digits, in lower case."""
        digest: str = self.text(data, key).lower()
        if not _HEX64.match(digest):
            self.fail(f"{key} {digest!r} is not 64 hex digits")
        return digest
