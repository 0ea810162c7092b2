"""A source's baseline commit made once and cloned: the commit hashing the tree makes."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tooling.patching import worktree


def _source(root: Path) -> Path:
    src = root / "vllm-9.9.9"
    (src / "vllm" / "sub").mkdir(parents=True)
    (src / "vllm" / "__init__.py").write_text("X = 1\n")
    (src / "vllm" / "sub" / "m.py").write_text("Y = 2\n")
    (src / "vllm" / "_version.py").write_text("v = '9.9.9'\n")  # ignored by .gitignore
    (src / ".gitignore").write_text("_version.py\n")
    tool = src / "tool.sh"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    os.symlink("vllm/__init__.py", src / "link.py")
    return src


def _files(tree: Path) -> dict[str, tuple[bytes | str, int]]:
    out: dict[str, tuple[bytes | str, int]] = {}
    for path in sorted(tree.rglob("*")):
        rel = path.relative_to(tree)
        if rel.parts[0] == ".git" or (path.is_dir() and not path.is_symlink()):
            continue
        st = path.lstat()
        content = os.readlink(path) if path.is_symlink() else path.read_bytes()
        out[str(rel)] = (content, st.st_mode & 0o111)
    return out


def test_a_cloned_baseline_is_the_commit_hashing_the_tree_makes(tmp_path) -> None:
    src, baselines = _source(tmp_path), tmp_path / "baselines"
    message = "upstream vLLM 9.9.9\n\nsdist sha256 x\n"
    hashed = worktree.create_from_tree(src, tmp_path / "a", message)
    cloned = worktree.create_from_tree(src, tmp_path / "b", message, baselines)
    again = worktree.create_from_tree(src, tmp_path / "c", message, baselines)
    sha = hashed.git.rev_parse(worktree.BASELINE_TAG)
    assert cloned.git.rev_parse(worktree.BASELINE_TAG) == sha == again.head.commit.hexsha
    assert len(list(baselines.glob("*.git"))) == 1  # made once
    assert _files(tmp_path / "b") == _files(tmp_path / "a") == _files(src)
    assert cloned.active_branch.name == worktree.BRANCH
    assert worktree.person_work(tmp_path / "c") == []  # ours, clean
    # The tree keeps its own objects: it outlives a cleared cache.
    shutil.rmtree(baselines)
    subprocess.run(["git", "-C", str(tmp_path / "c"), "fsck", "--strict"], check=True)
    assert again.git.show(f"{worktree.BASELINE_TAG}:vllm/sub/m.py") == "Y = 2"


def test_a_changed_source_gets_a_baseline_of_its_own(tmp_path) -> None:
    src, baselines = _source(tmp_path), tmp_path / "baselines"
    first = worktree.create_from_tree(src, tmp_path / "a", "m", baselines)
    (src / "vllm" / "sub" / "m.py").write_text("Y = 3  # changed\n")
    second = worktree.create_from_tree(src, tmp_path / "b", "m", baselines)
    assert first.head.commit.hexsha != second.head.commit.hexsha
    assert second.git.show("HEAD:vllm/sub/m.py") == "Y = 3  # changed"
    assert len(list(baselines.glob("*.git"))) == 2


def test_files_the_gitignore_hides_are_a_persons_work_and_move_aside(tmp_path) -> None:
    """A log, a virtualenv, a build folder: vLLM's .gitignore hides them from a plain
    ``git status``, yet they are a person's and must survive a new tree."""
    src = _source(tmp_path)
    (src / ".gitignore").write_text("_version.py\n*.log\n.venv/\nbuild/\n")
    work = tmp_path / "w"
    worktree.create_from_tree(src, work, "m", tmp_path / "baselines")
    (work / "vllm" / "__pycache__").mkdir()
    (work / "vllm" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"probes wrote it")
    assert worktree.person_work(work) == []
    (work / "bench.log").write_text("tokens/s 612\n")
    (work / ".venv" / "bin").mkdir(parents=True)
    (work / ".venv" / "bin" / "python").write_text("")
    (work / "build").mkdir()
    (work / "build" / "x").write_text("")
    assert worktree.person_work(work) == ["ignored .venv/", "ignored bench.log", "ignored build/"]
    saved = worktree.clear_way(work)
    assert saved is not None and not work.exists()
    assert (saved / "bench.log").read_text() == "tokens/s 612\n"
    assert (saved / ".venv" / "bin" / "python").is_file() and (saved / "build" / "x").is_file()
