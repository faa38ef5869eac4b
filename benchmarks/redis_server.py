"""A private ``redis-server`` on a free loopback port, started and stopped by its user: the remote
tier's tests (``tests/jit/test_remote.py``) and ``benchmarks/remote_cluster.py``.

Debian's package: ``apt-get install -y redis-server`` (``.ci/run`` installs it).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any


class NoRedisServer(RuntimeError):
    """No ``redis-server`` could be started here; the message says why."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``redis-server`` with no persistence, in ``folder``, on 127.0.0.1 only. ``extra``: more
    ``--option value`` arguments (``--maxmemory 1mb``)."""

    def __init__(self, folder: Path, *extra: str, tls: tuple[Path, Path] | None = None) -> None:
        self.folder = folder
        self.extra = list(extra)
        self.tls = tls  # (certificate, key): TLS only, the certificate also serving as the clients' CA
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls[0]}"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 20.0) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise NoRedisServer("no redis-server on PATH (apt-get install -y redis-server; .ci/run installs it)")
        self.folder.mkdir(parents=True, exist_ok=True)
        last = ""
        for _ in range(5):  # another process may take the free port between the probe and the bind
            self.port = _free_port()
            log = self.folder / f"redis-{self.port}.log"
            ports = ["--port", str(self.port)] if self.tls is None else \
                ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls[0]),
                 "--tls-key-file", str(self.tls[1]), "--tls-auth-clients", "no"]
            with open(log, "w") as out:
                self.proc = subprocess.Popen(
                    [exe, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                     "--dir", str(self.folder), "--daemonize", "no", *self.extra],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self._answers(log):
                    return self
                time.sleep(0.05)
            last = log.read_text()[-2000:]
            self.stop()
        raise NoRedisServer(f"redis-server did not start: {last}")

    def _answers(self, log: Path) -> bool:
        if self.tls is not None:  # no plain-text PING on a TLS port: the server says when it listens
            return "Ready to accept connections" in log.read_text()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url)

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, nothing answers (a hung server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
