"""Entry point inside the probed interpreter: run the named probes, write their verdicts as JSON.

Usage: python -m <pkg>.child OUT.json PROBE [PROBE ...]

vLLM logs to stdout, so results go to a file. A probe that raises becomes
``unknown`` with the exception as evidence; the other probes still run. The
file also lists what the run loaded (``imports``), which the toolchain keys
its cache of verdicts by (``tooling.probing.cache``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Iterable
from importlib import import_module

from .result import UNKNOWN, ProbeResult


def _run_one(name: str) -> ProbeResult:
    try:
        module = import_module(f"{__package__}.{name}")
        return module.run()
    except Exception as e:  # a probe must never take the others down
        last = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{last.filename.rsplit('/vllm/', 1)[-1]}:{last.lineno}"
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return ProbeResult(
            probe=name,
            status=UNKNOWN,
            evidence=f"{type(e).__name__} at {where}: {message}"[:400],
            details={"traceback": traceback.format_exc()[-4000:]},
        )


def _mapped_files() -> list[str]:
    """Every file mapped into this process: shared libraries loaded without a module
    (``torch.ops.load_library``, ctypes) as well as extension modules."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            fields = [line.split(maxsplit=5) for line in f]
    except OSError:  # not Linux: the extension modules' own files still count
        return []
    paths = {p[5].strip() for p in fields if len(p) == 6 and p[5].startswith("/")}
    # Regular files only: not /dev/zero, nor a deleted file's "(deleted)" mapping.
    return [p for p in paths if not p.startswith(("/dev/", "/proc/")) and os.path.isfile(p)]


def _attr(module: object, name: str) -> object:
    try:
        return getattr(module, name, None)
    except Exception:  # a lazy module's __getattr__ may raise anything
        return None


def imports() -> dict[str, list[str]]:
    """What the run loaded: files, the bytecode the import system read for them (wherever
    this interpreter's pycache prefix put it), package folders (a module added to one can
    change what an import finds), the search path and the top-level names imported."""
    modules = list(sys.modules.items())
    files = {_attr(m, "__file__") for _, m in modules} | set(_mapped_files())
    cached = {_attr(m, "__cached__") for _, m in modules}
    packages: set[object] = set()
    for _, m in modules:
        path = _attr(m, "__path__")  # a list, or a namespace package's _NamespacePath
        if isinstance(path, Iterable) and not isinstance(path, str):
            packages.update(path)
    return {
        "files": sorted(f for f in files if isinstance(f, str) and os.path.isabs(f)),
        "bytecode": sorted(
            c for c in cached if isinstance(c, str) and os.path.isabs(c) and os.path.isfile(c)
        ),
        "packages": sorted(p for p in packages if isinstance(p, str) and os.path.isabs(p)),
        "sys_path": list(sys.path),
        "top_level": sorted({name.partition(".")[0] for name, _ in modules}),
    }


def _imports_or_none() -> dict[str, list[str]] | None:
    try:
        return imports()
    except Exception:  # the verdicts still count; the toolchain just will not cache them
        return None


def main(argv: list[str]) -> int:
    out, names = argv[0], argv[1:]
    results = []
    try:
        import vllm

        version = getattr(vllm, "__version__", "?")
        location = vllm.__file__
    except Exception as e:
        version, location = None, f"{type(e).__name__}: {e}"
    for name in names:
        results.append(
            _run_one(name).to_json()
            if version
            else ProbeResult(
                probe=name, status=UNKNOWN, evidence=f"cannot import vllm: {location}"
            ).to_json()
        )
    with open(out, "w", encoding="utf-8") as f:
        json.dump(
            {
                "vllm_version": version,
                "vllm_location": location,
                "results": results,
                "imports": _imports_or_none(),
            },
            f,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
