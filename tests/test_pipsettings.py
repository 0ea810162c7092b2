"""pip's index settings reach uv: parsed from pip's own report, honoured by a real uv install."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tooling.paths import CacheLayout
from tooling.pipsettings import IndexSettings, parse_pip_config, read_pip_settings
from tooling.probing.env import REFERENCE_DFLASH, ensure_reference_dflash

from .wheels import build_wheel


@pytest.fixture
def pip_conf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A pip.conf of the test's own; the machine's PIP_* variables out of the way."""
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    conf = tmp_path / "pip.conf"
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    return conf


def test_parse_takes_the_environment_over_install_over_global() -> None:
    text = "\n".join(
        [
            ":env:.find-links='/env/wheels'",
            ":env:.index-url='https://mirror.example/simple'",
            "global.find-links='/a /b'",
            "global.extra-index-url='file:///x/simple file:///y/simple'",
            "global.constraint='/etc/c.txt'",
            "install.constraint='/tmp/c.txt'",
            "global.trusted-host='mirror.example'",
            "global.cert='/etc/ca.pem'",
            "global.no-index='true'",
            "global.timeout='30'",
            "not a setting",
        ]
    )
    settings = parse_pip_config(text)
    assert settings == IndexSettings(
        index_url="https://mirror.example/simple",
        extra_index_urls=("file:///x/simple", "file:///y/simple"),
        find_links=("/env/wheels",),
        constraints=("/tmp/c.txt",),
        trusted_hosts=("mirror.example",),
        no_index=True,
        cert="/etc/ca.pem",
    )
    args = settings.uv_args()
    assert args[:2] == ["--index-url", "https://mirror.example/simple"]
    assert args.count("--extra-index-url") == 2 and "--no-index" in args
    assert args[args.index("--find-links") + 1] == "/env/wheels"
    assert args[args.index("--constraint") + 1] == "/tmp/c.txt"
    assert args[args.index("--allow-insecure-host") + 1] == "mirror.example"
    # pip's rule across sources: the best version anywhere, not the first index's.
    assert args[-2:] == ["--index-strategy", "unsafe-best-match"]
    assert settings.uv_env() == {"SSL_CERT_FILE": "/etc/ca.pem"}
    assert parse_pip_config("").uv_args() == [] and parse_pip_config("").uv_env() == {}


def test_read_asks_this_interpreters_pip(pip_conf: Path, monkeypatch) -> None:
    pip_conf.write_text("[global]\nfind-links = /tmp/a /tmp/b\n[install]\nno-index = yes\n")
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    settings = read_pip_settings()
    assert settings.find_links == ("/tmp/a", "/tmp/b")
    assert settings.no_index is True
    assert settings.index_url == "https://mirror.example/simple"


def test_uv_installs_from_pips_find_links_alone(pip_conf: Path, tmp_path: Path) -> None:
    """With pip told `no-index` and a find-links folder, the reference package comes
    from that folder through uv, and nothing else is consulted."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    name, version = REFERENCE_DFLASH.split("==")
    build_wheel(wheels, name, version, modules={"model.py": b"ORIGIN = 'find-links'\n"})
    pip_conf.write_text(f"[global]\nfind-links = {wheels}\nno-index = true\n")
    cache = CacheLayout(tmp_path / "cache")
    target = ensure_reference_dflash(cache, Path(sys.executable))
    assert (target / name / "model.py").read_text() == "ORIGIN = 'find-links'\n"
