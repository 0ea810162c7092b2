"""Run as ``python -c <this file's text> SITE KNOWN TOP...`` by the interpreter of the install
under check (``tooling.verifying.bytecode``): stdlib only, its answer one JSON line on stdout.

For each pyc of this interpreter's cache tag under SITE/TOP that the import system would load
(its header matches the source), whether its code objects equal the source compiled afresh.
KNOWN (a file, or "-") lists the keys of (magic, optimization, source, pyc body) found equal
before: those are not compiled again. The keys found equal now are reported as "verified".
"""

import hashlib
import importlib.util
import json
import marshal
import os
import sys
from typing import Any

site, known_file, tops = sys.argv[1], sys.argv[2], sys.argv[3:]
known: set[str] = set()
if known_file != "-" and os.path.isfile(known_file):
    with open(known_file, encoding="ascii", errors="replace") as f:
        known = {line.strip() for line in f}
tag = sys.implementation.cache_tag
out: dict[str, Any] = {
    "tag": tag,
    "checked": 0,
    "known": 0,
    "stale": 0,
    "sourceless": 0,
    "other_tags": {},
    "differ": [],
    "verified": [],
}
for top in tops:
    for dirpath, _dirnames, filenames in os.walk(os.path.join(site, top)):
        if os.path.basename(dirpath) != "__pycache__":
            continue
        for name in filenames:
            parts = name.split(".")
            if parts[-1] != "pyc" or len(parts) < 3:
                continue
            if parts[1] != tag:
                out["other_tags"][parts[1]] = out["other_tags"].get(parts[1], 0) + 1
                continue
            opt = parts[2] if len(parts) == 4 else ""
            optimize = int(opt[4:]) if opt.startswith("opt-") else 0
            source = os.path.join(os.path.dirname(dirpath), parts[0] + ".py")
            pyc = os.path.join(dirpath, name)
            if not os.path.isfile(source):
                out["sourceless"] += 1  # never imported from __pycache__ without its source
                continue
            with open(pyc, "rb") as f:
                data = f.read()
            with open(source, "rb") as f:
                code = f.read()
            flags = int.from_bytes(data[4:8], "little") if len(data) >= 16 else -1
            if data[:4] != importlib.util.MAGIC_NUMBER or flags not in (0, 1, 3):
                out["stale"] += 1
                continue
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
                continue
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
                continue
            try:
                same = marshal.loads(data[16:]) == compile(
                    code, source, "exec", dont_inherit=True, optimize=optimize
                )
            except Exception:
                same = False
            if same:
                out["verified"].append(key)
            if not same:
                kind = {0: "timestamp", 1: "unchecked hash", 3: "checked hash"}[flags]
                out["differ"].append([os.path.relpath(pyc, site), kind])
print(json.dumps(out))
