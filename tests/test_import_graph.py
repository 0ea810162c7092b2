"""The shape of ``tooling``'s imports, read from the source with ``ast``: no module imports
itself through others, the stages import only earlier stages, and what runs in another
interpreter imports nothing of the toolchain around it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tooling.paths import PACKAGE_DIR

#: The pipeline's stages, in order: each may import the ones before it. ``host`` (the GPU
#: host's steps) runs the others there, and only the command line imports it.
STAGES = (
    "fetching",
    "patching",
    "building",
    "verifying",
    "smoke",
    "trained",
    "fuzzing",
    "release",
    "host",
)
#: Free to import everything: the command line, the program's entry, and the program that
#: renders the canary's page from a run (``python -m tooling.canary_doc``).
EDGE = ("cli", "__main__", "canary_doc")
#: Copied into the probed interpreter, where only its own modules are.
CHILD_ONLY = "probes"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imported(name: str, path: Path) -> Iterator[str]:
    """Every module of ``tooling`` that ``name`` imports, anywhere in it (a function's
    imports, or those only for type checking, included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # ``from . import x`` imports the module x where there is one.
            targets = [
                f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module
                for a in node.names
            ]
        else:
            continue
        yield from (t for t in targets if t in MODULES and t != name)


GRAPH = {name: set(_imported(name, path)) for name, path in MODULES.items()}


def _part(name: str) -> str:
    """The sub-package or top-level module of ``tooling`` that ``name`` belongs to."""
    return name.split(".")[1] if "." in name else ""


def _cycle() -> list[str] | None:
    """One cycle of the import graph, as the modules along it; None when there is none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        path.append(name)
        for target in sorted(GRAPH[name]):
            found = visit(target)
            if found:
                return found
        path.pop()
        done.add(name)
        return None

    for name in sorted(GRAPH):
        found = visit(name)
        if found:
            return found
    return None


def test_the_graph_is_read():
    """The walk finds the modules and the imports it is about, or the checks below hold of
    nothing."""
    assert {"tooling.cli", "tooling.probing.run", "tooling.patching.apply"} <= MODULES.keys()
    assert "tooling.probing.launch" in GRAPH["tooling.probing.run"]
    assert "tooling.fetching.upstream" in GRAPH["tooling.patching.apply"]
    assert {_part(n) for n in MODULES} >= {*STAGES, *EDGE, CHILD_ONLY}


def test_no_module_imports_itself_through_others():
    assert _cycle() is None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_stages_import_only_earlier_stages(module):
    """A stage imports itself, earlier stages and the shared modules; a shared module (one
    of no stage) imports no stage; the command line may import anything."""
    part = _part(module)
    if part in EDGE:
        return
    allowed = STAGES[: STAGES.index(part) + 1] if part in STAGES else ()
    later = sorted(t for t in GRAPH[module] if _part(t) in STAGES and _part(t) not in allowed)
    assert not later, f"{module} imports {later}"
    assert not any(_part(t) in EDGE for t in GRAPH[module]), f"{module} imports the CLI"


@pytest.mark.parametrize("module", sorted(n for n in MODULES if _part(n) == CHILD_ONLY))
def test_the_probes_import_only_each_other(module):
    outside = sorted(t for t in GRAPH[module] if _part(t) != CHILD_ONLY)
    assert not outside, f"{module} imports {outside}"


#: Run in interpreters of their own, started with the environment they are to read: the
#: probes, the smoke's, the trained pair's and the GPU fuzzer's serving children, verify's
#: in-install check, and the trainer
#: (``python -m tooling.trainer`` in the training interpreter).
CHILD_RUN = (
    "tooling.probes",
    "tooling.smoke.serving",
    "tooling.trained.serving",
    "tooling.fuzzing.serving",
    "tooling.verifying.inside",
    "tooling.trainer",
)
#: The process environment's variables that the library passes on to its children, adjusted
#: (the search path, the GPUs a child sees, git's home), or reads as the children do (where
#: CUDA's compiler is): none of them a setting of the toolchain's own.
PASSED_ON = {"PYTHONPATH", "CUDA_VISIBLE_DEVICES", "HOME", "CUDA_HOME"}


def _environment_reads(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Each use of the process environment in ``tree`` that is not a whole copy for a child
    (``dict(os.environ)``, ``{**os.environ, ...}``) nor a variable of ``PASSED_ON``: its line
    and what it reads."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def is_os(node: ast.AST, attr: str) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == attr
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        )

    def key_of(node: ast.AST) -> str | None:
        return (
            node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
        )

    def is_dict_call(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "dict"
        )

    for node in ast.walk(tree):
        if is_os(node, "getenv"):
            call = parents[node]
            key = key_of(call.args[0]) if isinstance(call, ast.Call) and call.args else None
            if key not in PASSED_ON:
                yield node.lineno, f"os.getenv({key!r})"
        if not is_os(node, "environ"):
            continue
        up = parents[node]
        if isinstance(up, ast.Subscript):
            key = key_of(up.slice)
        elif isinstance(up, ast.Attribute) and isinstance(parents[up], ast.Call):
            call = parents[up]
            key = key_of(call.args[0]) if call.args else None
        elif is_dict_call(up) or (isinstance(up, ast.IfExp) and is_dict_call(parents[up])):
            continue  # dict(os.environ), dict(os.environ if base is None else base): a copy
        elif isinstance(up, ast.Dict) and any(
            k is None and v is node for k, v in zip(up.keys, up.values, strict=True)
        ):
            continue  # {**os.environ, ...}: a copy for a child
        else:
            key = None
        if key not in PASSED_ON:
            yield node.lineno, f"os.environ[{key!r}]" if key else "os.environ as a whole"


def _own_process(*, edge: bool) -> dict[str, ast.AST]:
    """The parsed modules that run in the toolchain's own process (``edge``: with the command
    line's)."""
    return {
        name: ast.parse(path.read_text(encoding="utf-8"))
        for name, path in MODULES.items()
        if (edge or _part(name) not in EDGE) and not name.startswith(CHILD_RUN)
    }


def test_environment_variables_are_read_at_the_edge():
    """The command line reads the toolchain's variables and hands the library values; code
    that runs in a child interpreter reads the environment it was started with."""
    library = _own_process(edge=False)
    assert "tooling.probing.env" in library and "tooling.cli.environ" not in library
    reads = {
        name: found for name, tree in library.items() if (found := list(_environment_reads(tree)))
    }
    assert not reads


def test_an_environment_read_is_found():
    source = (
        "import os\n"
        "a = os.environ.get('TOOLING_X')\n"
        "b = os.environ['VLLM_DFLASH_CACHE']\n"
        "c = os.getenv('SOURCE_DATE_EPOCH')\n"
        "d = f(os.environ)\n"
        "e = dict(os.environ)\n"
        "h = dict(os.environ if a is None else a)\n"
        "g = {**os.environ, 'PYTHONPATH': os.environ.get('PYTHONPATH', '')}\n"
    )
    assert sorted(line for line, _ in _environment_reads(ast.parse(source))) == [2, 3, 4, 5]


#: What starts a process other than through ``tooling.procs``.
_STARTERS = {
    ("subprocess", "run"),
    ("subprocess", "Popen"),
    ("subprocess", "call"),
    ("subprocess", "check_call"),
    ("subprocess", "check_output"),
    ("os", "system"),
    ("os", "popen"),
}


def _process_starts(tree: ast.AST) -> list[str]:
    """The calls in ``tree`` that start a process directly (``subprocess.run``, ``os.system``
    and their kin), or import such a starter by name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and (owner.id, node.func.attr) in _STARTERS:
                found.append(f"{owner.id}.{node.func.attr} (line {node.lineno})")
        elif isinstance(node, ast.ImportFrom) and node.module in {"subprocess", "os"}:
            found += [
                f"from {node.module} import {a.name} (line {node.lineno})"
                for a in node.names
                if (node.module, a.name) in _STARTERS
            ]
    return found


def test_processes_start_through_procs():
    """One runner: a time limit, the process group stopped whole and its errors in one place;
    code that runs in a child interpreter is its own program."""
    library = _own_process(edge=True)
    assert {"tooling.procs", "tooling.cli.build"} <= library.keys()
    starts = {
        name: found
        for name, tree in library.items()
        if name != "tooling.procs" and (found := _process_starts(tree))
    }
    assert not starts


def test_a_direct_process_start_is_found():
    source = (
        "import os, subprocess\n"
        "from subprocess import check_output\n"
        "subprocess.run(['true'])\n"
        "p = subprocess.Popen(['true'])\n"
        "os.system('true')\n"
        "subprocess.TimeoutExpired('x', 1)\n"
    )
    assert len(_process_starts(ast.parse(source))) == 4
