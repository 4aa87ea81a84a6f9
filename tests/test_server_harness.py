"""A live `tokenloom serve` in a subprocess on an ephemeral loopback port, for the server tests.

Not a test module itself (it holds no tests): the test_server*.py modules share it. The server runs in
its own session, so teardown can reach its engine process even if the server misbehaves.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 180.0

# Servers started and not yet stopped, for the leak check after every test (tests/leak_check.py).
_live: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


def live_servers() -> list[ServerProcess]:
    return [s for s in list(_live) if s.proc is not None and s.proc.poll() is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class ServerProcess:
    def __init__(self, *args: str, api_key: str | None = None, log_path: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.env = env  # extra environment variables for the server (and its engine process)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.args = list(args) + ["--port", str(self.port)]
        if "--uvicorn-log-level" not in self.args:  # quiet by default; a test reading the log asks for info
            self.args += ["--uvicorn-log-level", "warning"]
        if api_key:
            self.args += ["--api-key", api_key]
        self.log_path = log_path or Path(os.environ.get("TMPDIR", "/tmp")) / f"tokenloom-serve-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self) -> None:
        t0 = time.monotonic()
        log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenloom.cli", "serve", *self.args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **self.env} if self.env else None,
        )
        deadline = t0 + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - t0
                    _live.add(self)
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def engine_pid(self) -> int:
        assert self.proc is not None
        for pid in children(self.proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                return pid
        raise RuntimeError("no engine process found")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        """Signal the server, wait for it, and make sure nothing of its session survives."""
        if self.proc is None:
            return None
        _live.discard(self)
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # stragglers of the session (there should be none)
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode

    def health_status(self) -> int:
        return httpx.get(self.url + "/health", timeout=5).status_code

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{labels}': value} (tokenloom: series only)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(tokenloom:[^ ]+) ([-+0-9.eE]+|NaN|[+-]Inf)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """One series' value, matching `name` and the given labels (0 if absent)."""
    for key, value in values.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return value
    return 0.0
