"""Run as ``python -c <this file's text> SITE KNOWN TOP...`` by the interpreter of the install
under check (``tooling.verifying.bytecode``): stdlib only, its answer one JSON line on stdout.

For each source under SITE/TOP, the pyc this interpreter would load for it, at each
optimization level: where ``importlib.util.cache_from_source`` puts it once site has run, so a
pycache prefix (``PYTHONPYCACHEPREFIX``, ``-X pycache_prefix``, or a ``.pth`` that sets
``sys.pycache_prefix``) is where it is looked for, as the import system does. Each one whose
header matches its source is compared with the source compiled afresh. KNOWN (a file, or "-")
lists the keys of (magic, optimization, source, pyc body) found equal before: those are not
compiled again. The keys found equal now are reported as "verified".
"""

import hashlib
import importlib.machinery
import importlib.util
import json
import marshal
import os
import sys
from typing import Any


def _answer(found: "dict[str, Any]") -> None:
    """The check's answer, its one line on stdout: the parent reads the last line as JSON."""
    print(json.dumps(found))


site, known_file, tops = sys.argv[1], sys.argv[2], sys.argv[3:]
known: set[str] = set()
if known_file != "-" and os.path.isfile(known_file):
    with open(known_file, encoding="ascii", errors="replace") as f:
        known = {line.strip() for line in f}
tag = sys.implementation.cache_tag
prefix = sys.pycache_prefix
out: dict[str, Any] = {
    "tag": tag,
    "prefix": prefix,
    "checked": 0,
    "known": 0,
    "stale": 0,
    "sourceless": 0,
    "other_tags": {},
    "differ": [],
    "verified": [],
}


def shown(path: str) -> str:
    """Relative to SITE when it lies there, else absolute (a pycache prefix's)."""
    rel = os.path.relpath(path, site)
    return path if rel.startswith(os.pardir) else rel


def in_tree_cache(dirpath: str, filenames: list[str]) -> None:
    """A ``__pycache__`` beside the sources: other tags are counted; this tag's pycs that the
    import system never reads (no source, or a prefix elsewhere) are counted as not loaded."""
    for name in filenames:
        parts = name.split(".")
        if parts[-1] != "pyc" or len(parts) < 3:
            continue
        if parts[1] != tag:
            out["other_tags"][parts[1]] = out["other_tags"].get(parts[1], 0) + 1
        elif not os.path.isfile(os.path.join(os.path.dirname(dirpath), parts[0] + ".py")):
            out["sourceless"] += 1  # never imported from __pycache__ without its source
        elif prefix is not None:
            out["stale"] += 1  # the import system looks under the prefix instead


def check(source: str, pyc: str, optimize: int) -> None:
    with open(pyc, "rb") as f:
        data = f.read()
    with open(source, "rb") as f:
        code = f.read()
    flags = int.from_bytes(data[4:8], "little") if len(data) >= 16 else -1
    if data[:4] != importlib.util.MAGIC_NUMBER or flags not in (0, 1, 3):
        out["stale"] += 1
        return
    if flags == 0:  # timestamp: loaded when mtime and size match
        st = os.stat(source)
        used = data[8:16] == (
            (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
            + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
        )
    elif flags == 3:  # checked hash: loaded when the source hash matches
        used = data[8:16] == importlib.util.source_hash(code)
    else:  # unchecked hash: loaded whatever the source says
        used = True
    if not used:
        out["stale"] += 1  # Python recompiles it instead of running it
        return
    out["checked"] += 1
    # The compiler's verdict is a function of these bytes alone (the file name is not
    # part of a code object's equality): a pair found equal once is equal again.
    key = hashlib.sha256(
        importlib.util.MAGIC_NUMBER
        + f"{optimize}\0".encode()
        + len(code).to_bytes(8, "little")
        + code
        + data[16:]
    ).hexdigest()[:40]
    if key in known:
        out["known"] += 1
        return
    try:
        same = marshal.loads(data[16:]) == compile(
            code, source, "exec", dont_inherit=True, optimize=optimize
        )
    except Exception:
        same = False
    if same:
        out["verified"].append(key)
    else:
        kind = {0: "timestamp", 1: "unchecked hash", 3: "checked hash"}[flags]
        out["differ"].append([shown(pyc), shown(source), kind])


for top in tops:
    for dirpath, _dirnames, filenames in os.walk(os.path.join(site, top)):
        if os.path.basename(dirpath) == "__pycache__":
            in_tree_cache(dirpath, filenames)
            continue
        for name in filenames:
            if not name.endswith(tuple(importlib.machinery.SOURCE_SUFFIXES)):
                continue
            source = os.path.join(dirpath, name)
            # Every level: which one runs is the -O of each start, not known here.
            for optimize in (0, 1, 2):
                pyc = importlib.util.cache_from_source(source, optimization=optimize or "")
                if os.path.isfile(pyc):
                    check(source, pyc, optimize)
_answer(out)
