"""``ci/gpu/hybrid-session.sh collect``: what a GPU session's device command brings back
while the session's steps run, on real files here as on the host."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from .helpers import run_gpu_script


def test_collect_brings_reports_and_logs_in_separate_archives(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    smoke = work / "session" / "tiny" / "default"
    (smoke / "logs").mkdir(parents=True)
    (smoke / "models").mkdir()
    (smoke / "report.json").write_text("{}")
    (smoke / "logs" / "serve-dflash.log").write_text("INFO ready\n")
    (smoke / "models" / "model.safetensors").write_bytes(os.urandom(1 << 20))
    (work / "session" / "session.log").write_text("[02:24:38] tiny\n")
    (work / "session" / "tiny.txt").write_text("production smoke default: exit 0\n")
    cache = work / "trained" / "vllm-cache-plain"
    cache.mkdir(parents=True)
    (cache / "compile.log").write_text("x")
    (work / "trained" / "plain.log").write_text("INFO plain\n")
    out.mkdir()
    done = run_gpu_script("hybrid-session.sh", "collect", work=work, out=out)
    assert done.returncode == 0, done.stderr
    assert "[02:24:38] tiny" in done.stdout
    texts = (out / "texts.txt").read_text()
    assert "== session/tiny.txt\nproduction smoke default: exit 0" in texts

    def names(archive: str) -> set[str]:
        with tarfile.open(out / archive) as tar:
            return set(tar.getnames())

    assert names("reports.tgz") == {"session/tiny/default/report.json", "session/tiny.txt"}
    # The models and the compile caches never: no command could bring them back.
    assert names("logs.tgz") == {
        "session/session.log",
        "session/tiny/default/logs/serve-dflash.log",
        "trained/plain.log",
    }
