"""``python -m tooling.trainer``: the recipe's command line."""

from __future__ import annotations

import sys

from .recipe import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
