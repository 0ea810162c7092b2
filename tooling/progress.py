"""Progress bars for downloads and long steps, quiet when output is not a terminal, and the
log handler that writes between them."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm


@contextmanager
def progress_bar(total: int | None, label: str, enabled: bool = True) -> Iterator[tqdm]:
    """A byte-counting bar on stderr; disabled off a TTY so CI logs stay readable."""
    show = enabled and sys.stderr.isatty()
    with tqdm(
        total=total,
        desc=label,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not show,
        leave=False,
        file=sys.stderr,
    ) as bar:
        yield bar


@contextmanager
def step_bar(total: int, label: str, enabled: bool = True) -> Iterator[tqdm]:
    """A bar that counts items (patches, releases, files) rather than bytes."""
    show = enabled and sys.stderr.isatty()
    with tqdm(total=total, desc=label, disable=not show, leave=False, file=sys.stderr) as bar:
        yield bar


class BarSafeHandler(logging.Handler):
    """Log lines on stderr that leave an active bar whole: tqdm clears it for the line and
    draws it again below. Writes to ``sys.stderr`` as it is at each line, not as it was when
    the handler was made (Click's test runner swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
            sys.stderr.flush()
        except Exception:
            self.handleError(record)
