"""``vllm serve`` command construction, and the stop logic against real stand-in processes.

The stand-in server is a real Python process that ignores SIGTERM (saying so in its
log), forks a grandchild that ignores it too (as vLLM's engine core might), and serves a
real ``/health`` over HTTP after a delay, noting in its log each time it answers.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from tooling import procs
from tooling.errors import SmokeError
from tooling.smoke.config import EngineSettings
from tooling.smoke.server import (
    ServeOptions,
    build_serve_command,
    child_environment,
    free_port,
    serve_environment,
    speculative_config,
    started,
)

from .helpers import wait_until

STANDIN = textwrap.dedent(
    """
    import http.server, os, signal, subprocess, sys, time

    port, delay, pidfile, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM ignored", flush=True))
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    with open(pidfile, "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    print("stand-in starting", flush=True)
    if mode == "crash":
        print("RuntimeError: CUDA out of memory (stand-in)", flush=True)
        sys.exit(3)
    time.sleep(delay)
    if mode == "silent":
        time.sleep(600)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                print("health answered", flush=True)
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


def _alive(pid: int) -> bool:
    """A pid that exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2] != "Z"


@pytest.fixture
def standin(tmp_path: Path):
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)

    def make(mode: str, delay: float = 0.3) -> tuple[list[str], str, Path, Path]:
        port = free_port()
        pidfile = tmp_path / f"pids-{mode}-{port}"
        cmd = [sys.executable, str(script), str(port), str(delay), str(pidfile), mode]
        return cmd, f"http://127.0.0.1:{port}", pidfile, tmp_path / f"{mode}-{port}.log"

    return make


def _pids(pidfile: Path) -> list[int]:
    wait_until(lambda: pidfile.is_file() and pidfile.read_text().strip(), "the stand-in's pids")
    return [int(p) for p in pidfile.read_text().split()]


def test_serve_command_for_dflash_server() -> None:
    options = ServeOptions("/m/target", "/m/drafter", EngineSettings(), port=8123)
    cmd = build_serve_command(options, python="/usr/bin/python3")
    assert cmd[:5] == ["/usr/bin/python3", "-m", "vllm.entrypoints.cli.main", "serve", "/m/target"]
    flags = dict(zip(cmd[5::2], cmd[6::2], strict=False))
    assert flags["--host"] == "127.0.0.1"
    assert flags["--port"] == "8123"
    assert flags["--attention-backend"] == "FLASH_ATTN"
    assert flags["--max-model-len"] == "1024"
    assert flags["--gpu-memory-utilization"] == "0.3"
    assert flags["--seed"] == "0"
    assert flags["--block-size"] == "16"
    # Compiled graphs (vLLM's default) unless asked; vLLM profiles the KV-cache size.
    assert "--enforce-eager" not in cmd
    assert "--kv-cache-memory-bytes" not in cmd
    assert "--disable-custom-all-reduce" not in cmd
    assert "--distributed-executor-backend" not in cmd  # vLLM's own choice
    assert "--enable-prefix-caching" in cmd
    assert "--enable-prompt-tokens-details" in cmd
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": "/m/drafter", "num_speculative_tokens": 3}
    assert spec == speculative_config("/m/drafter", EngineSettings())


def test_serve_command_carries_the_speculative_options_a_user_adds() -> None:
    """``--speculative-option``'s keys reach the DFlash server's ``--speculative-config``
    beside the smoke's own, with their JSON types; the plain server has none."""
    engine = EngineSettings(
        num_speculative_tokens=15,
        speculative_options=(("dflash_full_cudagraphs", True), ("join_hold_steps", 4)),
    )
    cmd = build_serve_command(ServeOptions(target="/m/t", drafter="/m/d", engine=engine))
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {
        "method": "dflash",
        "model": "/m/d",
        "num_speculative_tokens": 15,
        "dflash_full_cudagraphs": True,
        "join_hold_steps": 4,
    }
    plain = build_serve_command(ServeOptions(target="/m/t", drafter=None, engine=engine))
    assert "--speculative-config" not in plain


def test_serve_command_for_a_shared_gpu_and_a_hybrid_target() -> None:
    engine = EngineSettings(
        enforce_eager=True,
        block_size=None,
        kv_cache_memory_bytes=4 << 30,
        tensor_parallel_size=2,
        disable_custom_all_reduce=True,
    )
    options = ServeOptions("t", "d", engine, port=1, language_model_only=True)
    cmd = build_serve_command(options, python="py")
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert "--disable-custom-all-reduce" in cmd
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(4 << 30)
    assert "--block-size" not in cmd
    assert "--enforce-eager" in cmd
    assert "--language-model-only" in cmd


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_serve_command_and_environment_for_an_executor_backend(backend) -> None:
    engine = EngineSettings(tensor_parallel_size=2, distributed_executor_backend=backend)
    options = ServeOptions("t", "d", engine, port=1)
    cmd = build_serve_command(options, python="py")
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == backend
    base = {"RAY_ADDRESS": "10.0.0.1:6379", "NCCL_NVLS_ENABLE": "0"}
    env = serve_environment(options, base)
    # Ray: an instance of the server's own, whatever cluster the caller names; its workers
    # inherit the rest (NCCL's settings among them).
    assert env == {**base, "RAY_ADDRESS": "local" if backend == "ray" else "10.0.0.1:6379"}
    assert base["RAY_ADDRESS"] == "10.0.0.1:6379"
    # The plain server, the control, keeps vLLM's choice and the caller's environment.
    plain = ServeOptions("t", None, engine, port=2)
    assert "--distributed-executor-backend" not in build_serve_command(plain, python="py")
    assert serve_environment(plain, base) == base


def test_serve_command_without_drafter_keeps_caching_setting() -> None:
    plain = build_serve_command(ServeOptions("t", None, port=1), python="py")
    assert "--speculative-config" not in plain
    assert "--enable-prefix-caching" in plain
    off = build_serve_command(ServeOptions("t", None, prefix_caching=False, port=1), python="py")
    assert "--no-enable-prefix-caching" in off
    assert "--enable-prefix-caching" not in off


def test_child_environment_is_offline_and_keeps_the_install_path() -> None:
    env = child_environment({"PYTHONPATH": "/opt/bundle", "CUDA_VISIBLE_DEVICES": "3"})
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[0] == "/opt/bundle"  # the --target install keeps precedence
    assert (Path(parts[-1]) / "tooling" / "smoke").is_dir()


def test_started_server_waits_for_health_then_kills_a_stubborn_group_on_error(standin) -> None:
    cmd, url, pidfile, log = standin("stubborn")
    with (
        pytest.raises(RuntimeError, match="inside the block"),
        started(cmd, base_url=url, log=log, env=os.environ, stop_grace_s=1.0) as server,
    ):
        server.wait_healthy(20)
        pids = _pids(pidfile)
        assert all(_alive(p) for p in pids)
        # It did wait for the delayed /health: the stand-in logs before it answers.
        assert "health answered" in log.read_text()
        raise RuntimeError("inside the block")
    assert server.stop is not None
    # SIGTERM first, which the leader ignored, then SIGKILL.
    assert server.stop.how == procs.KILLED
    assert "SIGTERM ignored" in log.read_text()
    assert not server.stop.leftover
    assert not any(_alive(p) for p in pids)
    assert "stand-in starting" in log.read_text()


def test_started_server_stops_the_group_on_ctrl_c(standin) -> None:
    cmd, url, pidfile, log = standin("stubborn")
    with (
        pytest.raises(KeyboardInterrupt),
        started(cmd, base_url=url, log=log, env=os.environ, stop_grace_s=0.5) as server,
    ):
        server.wait_healthy(20)
        pids = _pids(pidfile)
        raise KeyboardInterrupt
    assert not any(_alive(p) for p in pids)


def test_cooperative_leader_is_terminated_and_its_stubborn_child_killed(standin) -> None:
    cmd, url, pidfile, log = standin("cooperative")
    with started(cmd, base_url=url, log=log, env=os.environ, stop_grace_s=1.0) as server:
        server.wait_healthy(20)
        pids = _pids(pidfile)
    assert server.stop is not None
    # The leader went on SIGTERM; its grandchild ignored it and needed SIGKILL.
    assert server.stop.how == procs.KILLED
    assert not any(_alive(p) for p in pids)


def test_server_that_exits_early_is_reported_with_its_last_log_line(standin) -> None:
    cmd, url, pidfile, log = standin("crash")
    with (
        pytest.raises(SmokeError, match="CUDA out of memory") as caught,
        started(cmd, base_url=url, log=log, env=os.environ, stop_grace_s=0.5) as server,
    ):
        server.wait_healthy(20)
        pytest.fail("the server must not become healthy")
    assert str(log) in str(caught.value)
    assert not any(_alive(p) for p in _pids(pidfile))


def test_health_time_limit_stops_the_server(standin) -> None:
    cmd, url, pidfile, log = standin("silent", delay=0.0)
    with (
        pytest.raises(SmokeError, match=r"did not answer within 1s"),
        started(cmd, base_url=url, log=log, env=os.environ, stop_grace_s=0.5) as server,
    ):
        server.wait_healthy(1.0)
        pytest.fail("the server must not become healthy")
    assert not any(_alive(p) for p in _pids(pidfile))


def test_run_child_time_limit(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    result = procs.run_child(
        [sys.executable, "-c", code], log=log, env=os.environ, timeout_s=0.5, grace_s=0.5
    )
    assert result.timed_out
    assert result.returncode == -9  # SIGKILL: it ignored SIGTERM


def test_run_child_success_and_log(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    result = procs.run_child(
        [sys.executable, "-c", "print('hello from child')"], log=log, env=os.environ, timeout_s=30
    )
    assert (result.returncode, result.timed_out) == (0, False)
    assert procs.log_tail(log) == "hello from child"
