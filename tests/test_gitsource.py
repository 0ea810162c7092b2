"""The git path of fetch against real repositories made here (file:// URLs)."""

from __future__ import annotations

from pathlib import Path

import git
import pytest
from click.testing import CliRunner

from tooling.cli import main
from tooling.errors import CacheMissError, ConfigError, GitSourceError
from tooling.fetching.bases import Artifact, Base, GitPin
from tooling.fetching.gitsource import fetch_git
from tooling.paths import REPO_DIR, CacheLayout


def make_remote(path: Path) -> tuple[git.Repo, str]:
    """A repo with vllm/ at tag v9.9.9 and a branch that moves past it."""
    repo = git.Repo.init(path, initial_branch="main")
    with repo.config_writer() as cw:
        cw.set_value("user", "name", "t").set_value("user", "email", "t@example.invalid")
    (path / "vllm").mkdir()
    (path / "vllm" / "__init__.py").write_text("__version__ = '9.9.9'\n")
    repo.index.add(["vllm/__init__.py"])
    tagged = repo.index.commit("release 9.9.9").hexsha
    repo.create_tag("v9.9.9")
    (path / "vllm" / "later.py").write_text("x = 1\n")
    repo.index.add(["vllm/later.py"])
    repo.index.commit("after the release")
    return repo, tagged


def base_pinned(commit: str) -> Base:
    return Base(
        version="9.9.9",
        release_date="2026-01-01",
        probe_env="latest",
        sdist=Artifact("vllm-9.9.9.tar.gz", "0" * 64),
        git=GitPin(tag="v9.9.9", commit=commit, commit_verified=True),
    )


@pytest.fixture
def remote(tmp_path):
    repo, tagged = make_remote(tmp_path / "remote")
    return repo, tagged, f"file://{tmp_path / 'remote'}"


def test_tag_resolves_to_the_pinned_commit(tmp_path, remote):
    _, tagged, url = remote
    cache = CacheLayout(tmp_path / "cache")
    got = fetch_git(base_pinned(tagged), cache, url=url)
    assert (got.ref_kind, got.commit) == ("tag", tagged)
    assert (got.source_dir / "vllm" / "__init__.py").read_text() == "__version__ = '9.9.9'\n"
    assert not (got.source_dir / "vllm" / "later.py").exists()


def test_an_abbreviated_pin_is_checked_as_a_prefix(tmp_path, remote):
    _, tagged, url = remote
    got = fetch_git(base_pinned(tagged[:9]), CacheLayout(tmp_path / "cache"), url=url)
    assert got.commit == tagged


def test_a_tag_that_moved_is_refused(tmp_path, remote):
    repo, tagged, url = remote
    repo.create_tag("v9.9.9", ref="HEAD", force=True)
    with pytest.raises(GitSourceError, match=f"resolves to .* but bases.toml pins {tagged}"):
        fetch_git(base_pinned(tagged), CacheLayout(tmp_path / "cache"), url=url)


def test_a_branch_is_refused_unless_asked_for(tmp_path, remote):
    repo, tagged, url = remote
    cache = CacheLayout(tmp_path / "cache")
    with pytest.raises(GitSourceError, match="is a branch"):
        fetch_git(base_pinned(tagged), cache, url=url, ref="main")
    got = fetch_git(base_pinned(tagged), cache, url=url, ref="main", allow_moving_ref=True)
    assert got.commit == repo.head.commit.hexsha and got.ref_kind == "branch"


def test_a_commit_id_is_accepted(tmp_path, remote):
    _, tagged, url = remote
    got = fetch_git(base_pinned(tagged), CacheLayout(tmp_path / "cache"), url=url, ref=tagged)
    assert (got.ref_kind, got.commit) == ("commit", tagged)


def test_missing_ref_and_missing_remote_are_clear_errors(tmp_path, remote):
    _, tagged, url = remote
    cache = CacheLayout(tmp_path / "cache")
    with pytest.raises(GitSourceError, match="ref 'v0.0.0' does not exist"):
        fetch_git(base_pinned(tagged), cache, url=url, ref="v0.0.0")
    missing = f"file://{tmp_path / 'nowhere'}"
    with pytest.raises(GitSourceError, match="cannot be read") as err:
        fetch_git(base_pinned(tagged), cache, url=missing)
    assert err.value.exit_code == 8
    assert not any(p.name.startswith("nowhere") for p in (tmp_path / "cache" / "git").iterdir())


def test_update_sees_new_tags_and_offline_uses_the_cache(tmp_path, remote):
    repo, tagged, url = remote
    cache = CacheLayout(tmp_path / "cache")
    fetch_git(base_pinned(tagged), cache, url=url)
    repo.create_tag("v9.9.10")
    # The update saw the new tag (else "does not exist"); it is another release, so refused.
    with pytest.raises(GitSourceError, match="'v9.9.10' resolves to .* not vLLM 9.9.9"):
        fetch_git(base_pinned(tagged), cache, url=url, ref="v9.9.10")
    offline = fetch_git(base_pinned(tagged), cache, url=url, offline=True)
    assert offline.commit == tagged
    with pytest.raises(CacheMissError, match="no cached clone"):
        fetch_git(base_pinned(tagged), CacheLayout(tmp_path / "empty"), url=url, offline=True)


def test_a_ref_of_another_release_is_refused(tmp_path, remote):
    """`--ref v0.22.0` on base 0.20.1 would be labelled 0.20.1: the ref must be the base."""
    repo, tagged, url = remote
    later = repo.head.commit.hexsha
    repo.create_tag("v9.10.0")
    cache = CacheLayout(tmp_path / "cache")
    for ref in ("v9.10.0", later):
        with pytest.raises(GitSourceError, match="not vLLM 9.9.9") as err:
            fetch_git(base_pinned(tagged), cache, url=url, ref=ref)
        assert err.value.exit_code == 8
    # A moving ref, when asked for, must still build on the base's commit.
    repo.git.checkout("-q", "--orphan", "elsewhere")
    repo.index.commit("unrelated history")
    with pytest.raises(GitSourceError, match="does not descend from vLLM 9.9.9"):
        fetch_git(base_pinned(tagged), cache, url=url, ref="elsewhere", allow_moving_ref=True)


def fetch_from_git(
    tmp_path: Path,
    *args: str,
    patches_dir: Path | None = None,
    env: dict[str, str] | None = None,
):
    """`tooling fetch --source git` with its own cache, as a user would type it."""
    group = ["--cache-dir", str(tmp_path / "cache")]
    if patches_dir is not None:
        group += ["--patches-dir", str(patches_dir)]
    return CliRunner().invoke(
        main, [*group, "fetch", "--source", "git", "--no-wheel", *args], env=env
    )


def patches_with(folder: Path, old: str, new: str) -> Path:
    """A --patches-dir whose bases.toml has ``old`` replaced by ``new``."""
    folder.mkdir()
    text = (REPO_DIR / "patches" / "bases.toml").read_text()
    assert old in text
    (folder / "bases.toml").write_text(text.replace(old, new, 1))
    return folder


def test_every_git_value_shaped_like_an_option_is_refused_before_git_runs(tmp_path, remote):
    """--git-url, --ref and bases.toml's git_url and tag reach git: an option-shaped one (a
    real --upload-pack payload) or one with a control character is one line, and runs nothing."""
    _, _, url = remote
    marker = tmp_path / "marker"
    payload = f"--upload-pack=touch {marker}"
    two_lines = f"{url}\nx"
    git_url_line = 'git_url = "https://github.com/vllm-project/vllm.git"'
    cases = [
        (("--git-url", payload, "--ref", "v0.20.1"), (), GitSourceError, f"git URL {payload!r}"),
        (("--git-url", url, "--ref", payload), (), GitSourceError, f"ref {payload!r}"),
        (("--git-url", two_lines), (), GitSourceError, f"git URL {two_lines!r}"),
        (("--git-url", url, "--ref", "v0.20.1\r"), (), GitSourceError, "ref 'v0.20.1\\r'"),
        ((), (git_url_line, f'git_url = "{payload}"'), ConfigError, f"git_url {payload!r}"),
        ((), ('tag = "v0.20.1"', f'tag = "{payload}"'), ConfigError, f"tag {payload!r}"),
    ]
    for i, (args, edit, error, named) in enumerate(cases):
        patches = patches_with(tmp_path / f"patches-{i}", *edit) if edit else None
        result = fetch_from_git(tmp_path, *args, patches_dir=patches)
        assert result.exit_code == error.exit_code, (args, edit, result.output)
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
        assert named in result.stderr, result.stderr
        if patches is not None:
            assert f"{patches / 'bases.toml'}: " in result.stderr, result.stderr
        assert not marker.exists(), (args, edit)
        # Refused before any clone was made: git never saw the value.
        assert not list((tmp_path / "cache" / "git").glob("*")), (args, edit)


def test_a_command_running_transport_is_refused_even_where_git_config_allows_it(tmp_path):
    """ext:: runs a command; a user's git config may allow every protocol (as the environment
    here does), the toolchain's git calls still refuse it."""
    marker = tmp_path / "marker"
    allow_all = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "protocol.allow"}
    result = fetch_from_git(
        tmp_path,
        "--git-url",
        f"ext::sh -c touch% {marker}",
        env={**allow_all, "GIT_CONFIG_VALUE_0": "always"},
    )
    assert result.exit_code == GitSourceError.exit_code, result.output
    assert "transport 'ext' not allowed" in result.stderr and result.stderr.count("\n") == 1
    assert not marker.exists()
