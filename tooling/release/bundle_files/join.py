#!/usr/bin/env python3
"""Join the parts of a vLLM DFlash bundle, check every sha256, unpack it.

Usage: python3 join.py [DEST]   (DEST defaults to this folder)

Needs only python3's standard library. Checks each part against SHA256SUMS
(naming any part that is missing or corrupt), joins them, checks the whole
archive's digest, then unpacks it into DEST and says how to install.
"""

import hashlib
import os
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))


def digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


USAGE = "usage: python3 join.py [DEST]"


def _say(line: str) -> None:
    """What the person who runs it reads: where the bundle is and how to install it."""
    print(line)


def _refuse(why: str, code: int = 1) -> int:
    """Why nothing was unpacked, one line on stderr; the exit code."""
    print("join.py: " + why, file=sys.stderr)
    return code


def main(argv: "list[str]") -> int:
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        return _refuse("unknown argument " + repr(argv[-1]) + " (" + USAGE + ")", 2)
    dest = os.path.abspath(argv[0]) if argv else HERE
    sums = {}
    try:
        with open(os.path.join(HERE, "SHA256SUMS"), encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    value, name = line.split(None, 1)
                    sums[name.strip().lstrip("*")] = value
    except (OSError, ValueError) as e:
        return _refuse("cannot read " + os.path.join(HERE, "SHA256SUMS") + ": " + str(e))
    archive = next((n for n in sums if n.endswith(".tar")), None)
    if archive is None:
        return _refuse("SHA256SUMS names no .tar archive")
    # By number: names carry three digits at least, so part-1000 sorts before part-101.
    parts = sorted(
        (n for n in sums if n.startswith(archive + ".part-")),
        key=lambda n: int(n.rsplit("-", 1)[1]),
    )
    bad = []
    for name in parts:
        path = os.path.join(HERE, name)
        if not os.path.isfile(path):
            bad.append(name + " is missing")
        elif digest(path) != sums[name]:
            bad.append(name + " is corrupt (sha256 differs from SHA256SUMS)")
    if bad:
        return _refuse("; ".join(bad))
    os.makedirs(dest, exist_ok=True)
    joined = os.path.join(dest, archive)
    tmp = joined + ".part"
    whole = hashlib.sha256()
    with open(tmp, "wb") as out:
        for name in parts:
            with open(os.path.join(HERE, name), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    whole.update(block)
                    out.write(block)
    if whole.hexdigest() != sums[archive]:
        os.remove(tmp)
        return _refuse("the joined " + archive + " does not match SHA256SUMS")
    os.replace(tmp, joined)
    with tarfile.open(joined) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:
            for member in tar.getmembers():
                if member.name.startswith(("/", "..")) or "/../" in member.name:
                    return _refuse("unsafe path " + member.name)
            tar.extractall(dest)
    os.remove(joined)
    folder = os.path.join(dest, archive[: -len(".tar")])
    _say("bundle ready: " + folder)
    _say("install: sh " + os.path.join(folder, "install.sh") + " [--target DIR]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
