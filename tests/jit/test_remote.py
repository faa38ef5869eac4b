"""The remote cache tier on a real redis-server (started here on a free loopback port): one build per
cluster, downloads that need no compiler, signed artifacts (anything else refused and built here), faults
that are never fatal, leases that outlive no builder, and the CLI's report, fill and clean."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers import ROOT, run_module, run_python
from helpers.userop import load_snippet, user_op_key, write_user_op

sys.path.insert(0, str(ROOT / "benchmarks"))
from redis_server import NoRedisServer, RedisServer  # noqa: E402  (benchmarks/ is no package)

from opbuilder.jit import cache, remote  # noqa: E402

RESULT = "RESULT [1.0, 3.0, 5.0, 7.0, 9.0]"


def _start(folder: Path, *extra: str, tls: tuple[Path, Path] | None = None) -> RedisServer:
    try:
        return RedisServer(folder, *extra, tls=tls).start()
    except NoRedisServer as exc:
        pytest.skip(f"the remote tier's tests need a redis-server, and none could be started here: {exc}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for the module (one per xdist worker); each test works under its own key prefix."""
    s = _start(tmp_path_factory.mktemp("redis"))
    yield s
    s.stop()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test alone: it is stopped, paused or filled."""
    s = _start(tmp_path / "redis")
    yield s
    s.stop()


def _secret_file(path: Path) -> Path:
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    return _secret_file(tmp_path / "secret")


def _env(server: RedisServer, secret: Path, prefix: str, **more: str) -> dict[str, str]:
    return {"OPB_REMOTE_CACHE": server.url, "OPB_REMOTE_CACHE_SECRET_FILE": str(secret),
            "OPB_REMOTE_CACHE_PREFIX": prefix, **more}


@pytest.fixture
def prefix() -> str:
    return f"opbtest:{uuid.uuid4().hex[:12]}"


def _push(built: tuple[Path, Path], env: dict[str, str]) -> str:
    """Share the user op's build from the built cache, in this process; returns its key."""
    op, built_cache = built
    key = user_op_key(op)
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {**env, "OPB_CACHE_DIR": str(built_cache)}.items():
            mp.setenv(name, value)
        tier = remote.tier(lines.append)
        assert tier is not None, lines
        outcome = tier.push(cache.Slot("add_scale", key), lines.append)
    assert outcome.startswith("shared"), (outcome, lines)
    return key


def _builds(stderr: str) -> int:
    return stderr.count("opbuilder: building add_scale")


def _only_build(cache_root: Path) -> tuple[Path, dict]:
    dirs = [p for p in (cache_root / "add_scale").iterdir() if p.is_dir()]
    assert len(dirs) == 1, f"expected one published build and no temporary folder, found {dirs}"
    return dirs[0], json.loads((dirs[0] / cache.MANIFEST).read_text())


class _Child:
    """A Python child whose stderr is read as it comes (to wait for a line)."""

    def __init__(self, code: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=ROOT, env={**os.environ, **env}, start_new_session=True)
        self.err: list[str] = []
        self.out = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    def stderr(self) -> str:
        return "".join(self.err)

    def wait(self, timeout: float = 300) -> int:
        assert self.proc.stdout is not None
        self.out = self.proc.stdout.read()
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def kill(self) -> None:
        """SIGKILL the child's process group (its own session): a node lost. Its ninja dies with it (a
        parent-death signal) and ends the compilers."""
        if self.proc.poll() is not None:  # ended and reaped: its id may be another process's by now
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # not reaped yet, so the id is still this child's
        except ProcessLookupError:
            pass
        self.proc.wait(30)


def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# A C++ compiler that waits, for the op's own source only, while the file $OPB_TEST_GATE exists: a build that
# is still running when the test acts. Ranks give the same CXX (the compiler is part of the key).
GATED_CXX = """#!/bin/sh
case "$*" in *add_scale.cpp*)
  while [ -n "$OPB_TEST_GATE" ] && [ -e "$OPB_TEST_GATE" ]; do sleep 0.05; done;;
esac
exec c++ "$@"
"""


def _gated_cxx(tmp_path: Path) -> Path:
    path = tmp_path / "gated-cxx"
    path.write_text(GATED_CXX)
    path.chmod(0o755)
    return path


# ---- one build per cluster -----------------------------------------------------------------------


@pytest.mark.slow
def test_one_build_across_groups_with_separate_caches(tmp_path: Path, server: RedisServer, secret: Path,
                                                      prefix: str) -> None:
    op = write_user_op(tmp_path / "proj")
    env = _env(server, secret, prefix)
    groups, ranks = 3, 2
    children = [_Child(load_snippet(op), {**env, "OPB_CACHE_DIR": str(tmp_path / f"node{g}")})
                for g in range(groups) for _ in range(ranks)]
    codes = [c.wait() for c in children]
    err = "".join(c.stderr() for c in children)
    assert codes == [0] * len(children), err
    assert all(RESULT in c.out for c in children), [c.out for c in children]
    assert _builds(err) == 1, err  # one compile in the whole "cluster"
    # Each other node downloaded it once (its second rank then found it in the node's cache).
    assert err.count("opbuilder: fetched add_scale from the remote cache") == groups - 1, err
    for g in range(groups):
        _only_build(tmp_path / f"node{g}")
    assert server.client().exists(f"{prefix}:build:add_scale:{user_op_key(op)}")


NO_COMPILER = """
import os, sys, torch
sys.path.insert(0, {root!r})
from my_ops import AddScaleBuilder
from opbuilder.jit import build
spec = AddScaleBuilder().build_spec()  # the key, worked out with this node's compiler (it is part of the key)
os.environ["CXX"] = "/nonexistent"     # from here on: no compiler, and no ninja on PATH
os.environ["PATH"] = "/nonexistent"
ns = build.build_and_load(spec)
print("RESULT", ns.add_scale(torch.arange(5, dtype=torch.float32)).tolist())
"""


def test_remote_hit_loads_with_no_compiler(tmp_path: Path, built_user_op: tuple[Path, Path], server: RedisServer,
                                           secret: Path, prefix: str) -> None:
    op = built_user_op[0]
    env = _env(server, secret, prefix)
    code = NO_COMPILER.format(root=str(op))
    # Without the entry, this process cannot build: the compiler is really gone.
    empty = run_python(code, env={**env, "OPB_CACHE_DIR": str(tmp_path / "empty")})
    assert empty.returncode != 0 and RESULT not in empty.stdout, empty.stderr[-2000:]

    _push(built_user_op, env)
    local = tmp_path / "node"
    result = run_python(code, env={**env, "OPB_CACHE_DIR": str(local)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert RESULT in result.stdout
    assert _builds(result.stderr) == 0 and "fetched add_scale" in result.stderr, result.stderr
    build_dir, manifest = _only_build(local)
    assert manifest["remote"]["from"] == server.url
    assert cache.check_build(build_dir)[0] is not None
    # A later process on this node loads it from the local cache: nothing printed, nothing fetched.
    again = run_python(load_snippet(op), env={**env, "OPB_CACHE_DIR": str(local)})
    assert again.returncode == 0 and RESULT in again.stdout and again.stderr == "", again.stderr


# ---- nothing foreign runs ------------------------------------------------------------------------


def _flip_library(client, name: str) -> None:  # noqa: ANN001
    library = bytearray(client.hget(name, "library"))
    library[len(library) // 2] ^= 0xFF
    client.hset(name, "library", bytes(library))


def _edit_manifest(client, name: str) -> None:  # noqa: ANN001
    manifest = json.loads(client.hget(name, "manifest"))
    manifest["build_seconds"] = 0.01
    client.hset(name, "manifest", json.dumps(manifest, indent=1, sort_keys=True).encode())


REFUSALS = {
    # name: (change to the stored entry, extra environment of the loader, what the warning says)
    "tampered library": (_flip_library, {}, "its signature does not match"),
    "tampered manifest": (_edit_manifest, {}, "its signature does not match"),
    "missing signature": (lambda client, name: client.hdel(name, "signature"), {}, "it has no signature"),
    "wrong secret": (None, {"OPB_REMOTE_CACHE_SECRET_FILE": "OTHER"}, "its signature does not match"),
    "over the size limit": (None, {"OPB_REMOTE_CACHE_MAX_BYTES": "1000"}, "over OPB_REMOTE_CACHE_MAX_BYTES"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_entry_is_refused_and_built_here(case: str, tmp_path: Path, built_user_op: tuple[Path, Path],
                                             server: RedisServer, secret: Path, prefix: str) -> None:
    change, extra, said = REFUSALS[case]
    env = _env(server, secret, prefix)
    key = _push(built_user_op, env)
    name = f"{prefix}:build:add_scale:{key}"
    if change is not None:
        change(server.client(), name)
    if extra.get("OPB_REMOTE_CACHE_SECRET_FILE") == "OTHER":
        extra = {"OPB_REMOTE_CACHE_SECRET_FILE": str(_secret_file(tmp_path / "other-secret"))}
    local = tmp_path / "node"
    result = run_python(load_snippet(built_user_op[0]), env={**env, **extra, "OPB_CACHE_DIR": str(local)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert RESULT in result.stdout
    assert "refusing add_scale's entry" in result.stderr and said in result.stderr, result.stderr
    assert _builds(result.stderr) == 1 and "fetched" not in result.stderr, result.stderr
    _, manifest = _only_build(local)
    assert "remote" not in manifest, "the build in the local cache must be this node's own"
    # The build here took the refused entry's place (it stayed there before, and every node built its own
    # until `opbuilder clean --remote`): the next node downloads it. One over this node's size limit is not
    # shared, so the entry there stays as it was; so does one whose signature does not match (another
    # secret's, maybe: good for the nodes of that secret), which the next node refuses and builds again.
    result = run_python(load_snippet(built_user_op[0]), env={**env, **extra, "OPB_CACHE_DIR": str(tmp_path / "next")})
    assert result.returncode == 0 and RESULT in result.stdout, result.stderr[-3000:]
    if case == "over the size limit":
        assert "not shared" in result.stderr and _builds(result.stderr) == 1, result.stderr
    elif said == "its signature does not match":
        assert "the entry is left" in result.stderr and _builds(result.stderr) == 1, result.stderr
    else:
        assert "fetched add_scale" in result.stderr and _builds(result.stderr) == 0, result.stderr


def test_entry_of_another_key_is_never_loaded(tmp_path: Path, built_user_op: tuple[Path, Path],
                                              server: RedisServer, secret: Path, prefix: str) -> None:
    env = _env(server, secret, prefix)
    key = _push(built_user_op, env)
    # Another torch, CUDA or source version is another key: its lookup never finds this entry.
    sys.path.insert(0, str(built_user_op[0]))
    try:
        from my_ops import AddScaleBuilder

        from opbuilder.jit import fingerprint

        inputs = AddScaleBuilder().key_inputs()
        assert fingerprint.cache_key(inputs) == key
        for field, other in (("torch", "2.99.0"), ("torch_cuda", "99.0"), ("abi", "stable-0x02ff")):
            assert fingerprint.cache_key({**inputs, field: other}) != key, field
    finally:
        sys.path.remove(str(built_user_op[0]))
        sys.modules.pop("my_ops", None)
    # Another source version, with this key's entry planted under its own key: refused, built here.
    changed = write_user_op(tmp_path / "changed", offset=2.0)
    other_key = user_op_key(changed)
    assert other_key != key
    client = server.client()
    client.copy(f"{prefix}:build:add_scale:{key}", f"{prefix}:build:add_scale:{other_key}")
    local = tmp_path / "node"
    result = run_python(load_snippet(changed), env={**env, "OPB_CACHE_DIR": str(local)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESULT [2.0, 4.0, 6.0, 8.0, 10.0]" in result.stdout, "the planted library must not be loaded"
    assert "its signature does not match" in result.stderr and _builds(result.stderr) == 1, result.stderr


def test_entry_missing_its_library_is_built_and_replaced(tmp_path: Path, built_user_op: tuple[Path, Path],
                                                         server: RedisServer, secret: Path, prefix: str) -> None:
    env = _env(server, secret, prefix)
    key = _push(built_user_op, env)
    name = f"{prefix}:build:add_scale:{key}"
    client = server.client()
    client.hdel(name, "library")  # what an eviction of a part, or a half-done write, would leave
    result = run_python(load_snippet(built_user_op[0]), env={**env, "OPB_CACHE_DIR": str(tmp_path / "node")})
    assert result.returncode == 0 and RESULT in result.stdout, result.stderr[-3000:]
    assert _builds(result.stderr) == 1, result.stderr
    assert client.hexists(name, "library") and client.hexists(name, "signature"), "the build here was shared"


def test_tier_refuses_to_start_without_a_private_secret(tmp_path: Path, server: RedisServer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    monkeypatch.setenv("OPB_REMOTE_CACHE", server.url)
    monkeypatch.setenv("OPB_REMOTE_CACHE_PREFIX", f"opbtest:{uuid.uuid4().hex[:12]}")
    monkeypatch.delenv("OPB_REMOTE_CACHE_SECRET_FILE", raising=False)
    assert remote.tier(lines.append) is None
    assert len(lines) == 1 and "OPB_REMOTE_CACHE_SECRET_FILE is not set" in lines[0], lines
    readable = _secret_file(tmp_path / "readable")
    readable.chmod(0o644)
    monkeypatch.setenv("OPB_REMOTE_CACHE_SECRET_FILE", str(readable))
    assert remote.tier(lines.append) is None
    assert "can be read or written by others (mode 644)" in lines[-1] and "chmod 600" in lines[-1], lines
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    monkeypatch.setenv("OPB_REMOTE_CACHE_SECRET_FILE", str(short))
    assert remote.tier(lines.append) is None
    assert "has 3 bytes" in lines[-1], lines
    assert remote.describe()["why_not"] == lines[-1].split(" not used: ", 1)[1]


@pytest.mark.parametrize("url", ["redis://:hunter2@127.0.0.1:notaport/0", "redis://:hunter2@127.0.0.1:99999/0",
                                 "redis://:pw1/pw2@127.0.0.1:6379/0", "http://:hunter2@127.0.0.1:x/0"])
def test_url_with_a_bad_port_is_said_without_its_password(url: str, secret: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A malformed OPB_REMOTE_CACHE (a port that is no number, a password with an unescaped "/") is one line
    naming the variable, the tier unused, as for a wrong scheme: never a ValueError of urllib, nor a message
    showing a piece of the password."""
    lines: list[str] = []
    monkeypatch.setenv("OPB_REMOTE_CACHE", url)
    monkeypatch.setenv("OPB_REMOTE_CACHE_PREFIX", f"opbtest:{uuid.uuid4().hex[:12]}")
    monkeypatch.setenv("OPB_REMOTE_CACHE_SECRET_FILE", str(secret))
    assert remote.tier(lines.append) is None
    assert len(lines) == 1 and "OPB_REMOTE_CACHE must be redis://" in lines[0], lines
    shown = lines[0] + json.dumps(remote.describe())
    assert not any(piece in shown for piece in ("hunter2", "pw1", "pw2")), shown


@pytest.mark.parametrize("variable", ["OPB_REMOTE_CACHE_TIMEOUT", "OPB_REMOTE_LEASE_SECONDS"])
@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "0", "soon"])
def test_seconds_that_no_socket_or_lease_can_take_are_an_error_naming_the_variable(
        variable: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """inf or 1e300 seconds passed the check and then ended the load in an OverflowError of the socket
    timeout or of the lease's milliseconds (or a lease the server refused, the tier silently unused)."""
    from opbuilder import env
    from opbuilder.errors import EnvError

    monkeypatch.setenv(variable, value)
    with pytest.raises(EnvError, match=f"{variable} must be .* got {value!r}"):
        env.validate()


def test_library_over_the_size_limit_is_not_shared(built_user_op: tuple[Path, Path], server: RedisServer,
                                                   secret: Path, prefix: str) -> None:
    env = _env(server, secret, prefix, OPB_REMOTE_CACHE_MAX_BYTES="1000")
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {**env, "OPB_CACHE_DIR": str(built_user_op[1])}.items():
            mp.setenv(name, value)
        tier = remote.tier(lines.append)
        assert tier is not None
        outcome = tier.push(cache.Slot("add_scale", user_op_key(built_user_op[0])), lines.append)
    assert outcome.startswith("not shared") and "OPB_REMOTE_CACHE_MAX_BYTES (1000)" in outcome, outcome
    assert not list(server.client().scan_iter(match=f"{prefix}:build:*"))


def test_tls_and_a_password_in_a_file_or_the_url(tmp_path: Path, built_user_op: tuple[Path, Path], secret: Path,
                                                  prefix: str) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to make the TLS server's certificate")
    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key_file), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    password = secrets.token_hex(16)
    tls_server = _start(tmp_path / "redis", "--requirepass", password, tls=(cert, key_file))
    try:
        assert tls_server.url.startswith("rediss://")
        password_file = tmp_path / "password"
        password_file.write_text(password + "\n")
        password_file.chmod(0o600)
        env = _env(tls_server, secret, prefix, OPB_REMOTE_CACHE_PASSWORD_FILE=str(password_file))
        key = _push(built_user_op, env)  # over TLS, with the password from the file
        with_url = {**env, "OPB_REMOTE_CACHE": tls_server.url.replace("rediss://", f"rediss://:{password}@"),
                    "OPB_REMOTE_CACHE_PASSWORD_FILE": ""}
        wrong = {**with_url, "OPB_REMOTE_CACHE": tls_server.url.replace("rediss://", "rediss://:wrong-password@")}
        said: list[str] = []
        seen = {}
        for name, variables in (("file", env), ("url", with_url), ("wrong", wrong)):
            with pytest.MonkeyPatch.context() as mp:
                for var, value in variables.items():
                    mp.setenv(var, value)
                tier = remote.tier(said.append)
                assert tier is not None, said
                seen[name] = remote.describe()
                if name != "wrong":
                    entry = tier.store.get("add_scale", key)
                    assert entry is not None and entry.signature is not None
                    assert tier._check("add_scale", key, entry)[1] is None
        assert seen["file"]["reachable"] and seen["file"]["entries"] == 1, seen["file"]
        assert seen["url"]["reachable"] and seen["url"]["entries"] == 1, seen["url"]
        assert seen["wrong"]["reachable"] is False and "AuthenticationError" in seen["wrong"]["why_not"], seen["wrong"]
        shown = json.dumps(seen) + "".join(said)
        assert password not in shown and "wrong-password" not in shown, "a password was shown"
    finally:
        tls_server.stop()


class MemoryStore(remote.RemoteCache):
    """The whole ``RemoteCache`` interface on a dict, as a store other than Redis would implement it; ``down``
    makes every call fail as an unreachable server's would."""

    def __init__(self) -> None:
        self.where, self.prefix = "memory://test", "test"
        self.entries: dict[tuple[str, str], remote.Entry] = {}
        self.leases: dict[tuple[str, str], tuple[str, float]] = {}
        self.failures: dict[tuple[str, str], dict] = {}
        self.down = False

    def _up(self) -> None:
        if self.down:
            raise remote.RemoteUnavailable("ConnectionError: memory store switched off")

    def ping(self) -> None:
        self._up()

    def size(self, op: str, key: str) -> int | None:
        self._up()
        entry = self.entries.get((op, key))
        if entry is None or not entry.library:
            return None
        return sum(len(v) for v in (entry.manifest, entry.library, entry.log, entry.signature) if v is not None)

    def get(self, op: str, key: str) -> remote.Entry | None:
        self._up()
        return self.entries.get((op, key))

    def put(self, op: str, key: str, entry: remote.Entry) -> None:
        self._up()
        self.entries[(op, key)] = entry
        self.failures.pop((op, key), None)

    def _holder(self, op: str, key: str) -> str | None:
        owner, until = self.leases.get((op, key), (None, 0.0))
        return owner if until > time.monotonic() else None

    def state(self, op: str, key: str) -> remote.State:
        self._up()
        return remote.State((op, key) in self.entries, self._holder(op, key), self.failures.get((op, key)))

    def acquire_lease(self, op: str, key: str, owner: str, seconds: float) -> bool:
        self._up()
        if self._holder(op, key) is not None:
            return False
        self.leases[(op, key)] = (owner, time.monotonic() + seconds)
        return True

    def renew_lease(self, op: str, key: str, owner: str, seconds: float) -> bool:
        self._up()
        if self._holder(op, key) != owner:
            return False
        self.leases[(op, key)] = (owner, time.monotonic() + seconds)
        return True

    def release_lease(self, op: str, key: str, owner: str) -> None:
        self._up()
        if self._holder(op, key) == owner:
            del self.leases[(op, key)]

    def put_failure(self, op: str, key: str, record: dict, seconds: float) -> None:
        self._up()
        self.failures[(op, key)] = record

    def remove(self, ops: list[str] | None) -> int:
        self._up()
        gone = [k for k in self.entries if ops is None or k[0] in ops]
        for k in gone:
            del self.entries[k]
        return len(gone)

    def count(self) -> int:
        self._up()
        return len(self.entries)


def memory_tier(tmp_path: Path, built_user_op: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch):
    """(a MemoryStore, a Tier on it, the user op's key, its slot), OPB_CACHE_DIR a copy of the built cache."""
    from helpers import copy_cache

    from opbuilder.jit.remote.tier import Tier

    store = MemoryStore()
    tier = Tier(store, secrets.token_bytes(32), 1 << 30, 5.0)
    key = user_op_key(built_user_op[0])
    monkeypatch.setenv("OPB_CACHE_DIR", str(copy_cache(built_user_op[1], tmp_path / "builder")))
    return store, tier, key, cache.Slot("add_scale", key)


def test_the_tier_on_another_store_outage_said_once_then_recovery(
        tmp_path: Path, built_user_op: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import copy_cache

    from opbuilder.jit.remote.tier import Tier

    store = MemoryStore()
    tier = Tier(store, secrets.token_bytes(32), 1 << 30, 5.0)
    key = user_op_key(built_user_op[0])
    builder_cache = copy_cache(built_user_op[1], tmp_path / "builder")
    monkeypatch.setenv("OPB_CACHE_DIR", str(builder_cache))
    slot = cache.Slot("add_scale", key)
    said: list[str] = []
    builds: list[int] = []

    def build() -> Path:  # the node's own build: here, the one already in its cache
        builds.append(1)
        return slot.path

    store.down = True
    for _ in range(2):  # an outage: the op is built here, and said once
        assert tier.obtain(slot, build, said.append) == slot.path
        tier._down_until = 0.0  # as if the pause after a fault had passed
    assert len(builds) == 2 and store.entries == {}
    assert [ln for ln in said if "failed" in ln] == said and len(said) == 1, said

    store.down = False
    assert tier.obtain(slot, build, said.append) == slot.path  # built under the lease, then shared
    assert said[1] == "remote cache memory://test answers again", said
    assert len(builds) == 3 and (("add_scale", key) in store.entries) and not store.leases

    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "other-node"))
    fetched = tier.obtain(cache.Slot("add_scale", key), build, said.append)
    assert len(builds) == 3, "a stored entry is downloaded, not built"
    artifact, manifest, why = cache.check_build(fetched)
    assert artifact is not None and manifest is not None and manifest["remote"]["from"] == "memory://test", why
    assert said[-1].startswith("fetched add_scale from the remote cache memory://test"), said



def test_a_refused_entry_is_replaced_once_and_one_that_does_not_load_here_is_kept(
        tmp_path: Path, built_user_op: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad entry is rebuilt under the lease and shared in its place, not when another rank holds the lease
    (that rank replaces it; waiting would download the bad entry again); a good entry that does not load on
    this node (``reject_build_id``) is built here and left for the nodes it loads on."""
    store, tier, key, slot = memory_tier(tmp_path, built_user_op, monkeypatch)
    builds: list[int] = []

    def build() -> Path:  # the node's own build: here, the one already in its cache
        builds.append(1)
        return slot.path

    assert tier.push(slot, print).startswith("shared")
    good = store.entries[("add_scale", key)]
    store.entries[("add_scale", key)] = bad = remote.Entry(good.manifest, good.library, good.log, None)  # half-written

    store.leases[("add_scale", key)] = ("another rank", time.monotonic() + 60)
    said: list[str] = []
    assert tier.obtain(slot, build, said.append) == slot.path
    assert len(builds) == 1 and store.entries[("add_scale", key)] is bad, said
    assert any("refusing add_scale's entry" in line for line in said), said

    store.leases.clear()
    assert tier.obtain(slot, build, said.append) == slot.path
    assert len(builds) == 2 and not store.leases
    assert store.entries[("add_scale", key)].signature == good.signature, "the build here took the bad one's place"

    build_id = json.loads(good.manifest)["build_id"]
    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "other-node"))
    other = cache.Slot("add_scale", key)
    said.clear()
    assert tier.obtain(other, lambda: (builds.append(1), slot.path)[1], said.append, reject_build_id=build_id) \
        == slot.path
    assert len(builds) == 3 and store.entries[("add_scale", key)].signature == good.signature
    assert any("does not load here" in line for line in said), said


class SharedJustBeforeTheLease(MemoryStore):
    """Another rank's build ends between this rank's look and its lease: the entry is put (``put_at_lease``)
    just before the first lease this rank takes, as that rank uploads and then releases its lease."""

    def __init__(self, put_at_lease: tuple[tuple[str, str], remote.Entry]) -> None:
        super().__init__()
        self.put_at_lease: tuple | None = put_at_lease

    def acquire_lease(self, op: str, key: str, owner: str, seconds: float) -> bool:
        if self.put_at_lease is not None:
            where, entry = self.put_at_lease
            self.entries[where], self.put_at_lease = entry, None
        return super().acquire_lease(op, key, owner, seconds)


@pytest.mark.parametrize("before", ["none", "refused"])
def test_an_entry_shared_between_the_look_and_the_lease_is_downloaded_not_built(
        before: str, tmp_path: Path, built_user_op: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """One build per cluster: a rank that found no entry (or a bad one) and then took the lease built the op
    again where the builder had shared it and freed the lease in between. It looks again under the lease; a
    bad entry still there is replaced (one build), as before."""
    from helpers import copy_cache

    from opbuilder.jit.remote.tier import Tier

    secret = secrets.token_bytes(32)
    key = user_op_key(built_user_op[0])
    builder = copy_cache(built_user_op[1], tmp_path / "builder")
    monkeypatch.setenv("OPB_CACHE_DIR", str(builder))
    slot = cache.Slot("add_scale", key)
    source = MemoryStore()
    assert Tier(source, secret, 1 << 30, 5.0).push(slot, print).startswith("shared")
    good = source.entries[("add_scale", key)]
    bad = remote.Entry(good.manifest, good.library, good.log, None)  # half-written

    for replaced in (True, False):
        store = SharedJustBeforeTheLease((("add_scale", key), good if replaced else bad))
        if before == "refused":
            store.entries[("add_scale", key)] = bad
        elif not replaced:
            continue  # no entry, none shared meanwhile: the plain build under the lease, tested elsewhere
        tier = Tier(store, secret, 1 << 30, 5.0)
        # a node with an empty cache where the entry comes; else the builder's (its build is what gets shared)
        monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / f"node-{before}" if replaced else builder))
        builds: list[int] = []
        said: list[str] = []
        other = cache.Slot("add_scale", key)
        found = tier.obtain(other, lambda: (builds.append(1), slot.path)[1], said.append)
        assert not store.leases, "the lease is released"
        if replaced:
            assert builds == [] and found == other.path, said
            assert any(line.startswith("fetched add_scale") for line in said), said
        else:  # the bad entry is still there: built once, and shared in its place
            assert builds == [1] and store.entries[("add_scale", key)].signature == good.signature, said
        assert sum("refusing add_scale's entry" in line for line in said) == (before == "refused"), said


def test_a_lease_whose_renewer_cannot_start_is_built_under_and_released(
        tmp_path: Path, built_user_op: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread to renew the lease (``can't start new thread``): the error left the lease held until it
    expired, every other rank waiting on it, and this rank's build never ran. Now it builds, says the lease is
    not renewed, shares the build and frees the lease."""
    import importlib

    tier_module = importlib.import_module("opbuilder.jit.remote.tier")  # the package's ``tier`` is a function

    class NoThread:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    store, tier, key, slot = memory_tier(tmp_path, built_user_op, monkeypatch)
    builds: list[int] = []
    said: list[str] = []
    import threading
    import types

    # the tier module's threading only: the rest of the process keeps its threads
    monkeypatch.setattr(tier_module, "threading", types.SimpleNamespace(Thread=NoThread, Event=threading.Event))
    assert tier.obtain(slot, lambda: (builds.append(1), slot.path)[1], said.append) == slot.path
    assert builds == [1] and not store.leases and ("add_scale", key) in store.entries, said
    assert any("is not renewed (can't start new thread)" in line for line in said), said


def test_an_entry_signed_with_another_secret_is_built_here_and_kept(
        tmp_path: Path, built_user_op: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A signature that does not match cannot tell a damaged entry from one signed with another secret (a node
    whose secret file differs, or a rotation half done): the node builds for itself and leaves the entry, which
    is good for the nodes of the cluster's secret. Replacing it made every such node and every node of the
    secret replace each other's entry in turn, each replacement a build on the other side."""
    from helpers import copy_cache

    from opbuilder.jit.remote.tier import Tier

    store = MemoryStore()
    cluster, odd = Tier(store, secrets.token_bytes(32), 1 << 30, 5.0), Tier(store, secrets.token_bytes(32), 1 << 30, 5.0)
    key = user_op_key(built_user_op[0])
    monkeypatch.setenv("OPB_CACHE_DIR", str(copy_cache(built_user_op[1], tmp_path / "builder")))
    slot = cache.Slot("add_scale", key)
    assert cluster.push(slot, print).startswith("shared")
    good = store.entries[("add_scale", key)]
    builds: list[int] = []

    def build() -> Path:  # the node's own build: here, the one already in its cache
        builds.append(1)
        return slot.path

    said: list[str] = []
    assert odd.obtain(slot, build, said.append) == slot.path  # the node of another secret
    assert len(builds) == 1 and any("its signature does not match" in line for line in said), said
    assert store.entries[("add_scale", key)] is good and not store.leases
    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "next-node"))
    said.clear()
    fetched = cluster.obtain(cache.Slot("add_scale", key), build, said.append)  # a node of the cluster's secret
    assert len(builds) == 1 and fetched.is_relative_to(tmp_path / "next-node"), said


def test_failure_record_not_signed_with_the_secret_is_not_believed(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure record is read from Redis like an entry: one that anybody with write access to the store could
    have put there (a lease and a record naming the same holder) must not fail the waiting ranks."""
    from opbuilder.errors import BuildError
    from opbuilder.jit.remote.tier import Tier

    store = MemoryStore()
    secret = secrets.token_bytes(32)
    waiter = Tier(store, secret, 1 << 30, 5.0)
    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "cache"))
    key = "k" * 20
    slot = cache.Slot("add_scale", key)
    cache.ensure_dir(slot.op_dir)
    said: list[str] = []
    builds: list[int] = []

    def build() -> Path:
        builds.append(1)
        return slot.path

    store.leases[("add_scale", key)] = ("evil", time.monotonic() + 0.5)
    store.failures[("add_scale", key)] = {"owner": "evil", "time": time.time(), "message": "forged failure", "log": ""}
    assert waiter.obtain(slot, build, said.append) == slot.path  # the forged record ignored: built here
    assert builds == [1] and cache.read_failure(slot) is None, said

    # A failure recorded by a rank with the secret is still handed to the ranks waiting for it.
    store.failures.clear()

    def fails() -> Path:
        raise BuildError("the compiler failed")

    with pytest.raises(BuildError):
        Tier(store, secret, 1 << 30, 5.0).obtain(slot, fails, said.append)
    record = store.failures[("add_scale", key)]
    store.leases[("add_scale", key)] = (record["owner"], time.monotonic() + 5)
    with pytest.raises(BuildError, match="the compiler failed"):
        waiter.obtain(slot, build, said.append)
    # ... but not under another secret's signature.
    store.leases[("add_scale", key)] = (record["owner"], time.monotonic() + 0.5)
    assert Tier(store, secrets.token_bytes(32), 1 << 30, 5.0).obtain(slot, build, said.append) == slot.path


def test_failure_record_too_deep_to_parse_is_ignored(server: RedisServer, prefix: str) -> None:
    from opbuilder.jit.remote.redis_backend import RedisCache

    store = RedisCache(server.url, prefix, 5.0)
    server.client().set(f"{prefix}:failed:add_scale:k", "[" * 100_000 + "]" * 100_000)
    assert store.state("add_scale", "k").failure is None


def test_entry_with_a_signature_that_is_not_ascii_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signature field of bytes that are not ASCII (damaged or forged) is refused, not a TypeError of
    hmac.compare_digest that ends the rank."""
    from opbuilder.jit.remote.tier import Tier

    store = MemoryStore()
    tier = Tier(store, secrets.token_bytes(32), 1 << 30, 5.0)
    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "cache"))
    slot = cache.Slot("add_scale", "k" * 20)
    cache.ensure_dir(slot.op_dir)
    store.entries[("add_scale", slot.key)] = remote.Entry(b"{}", b"library", b"", "\ufffd" * 64)
    said: list[str] = []
    assert tier.obtain(slot, lambda: slot.path, said.append) == slot.path
    assert any("refusing add_scale's entry" in line and "signature does not match" in line for line in said), said


def test_entry_with_a_huge_log_or_manifest_is_refused_before_its_download(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: RedisServer, prefix: str) -> None:
    """Only the library's size was asked before the download: an entry with a library of 7 bytes and a log or
    manifest of hundreds of MiB (damaged or hostile) was downloaded whole, into every waiting rank's memory,
    before its signature refused it. The size asked first is the whole entry's, against the library's limit
    plus what a log and a manifest of ours can take."""
    from opbuilder.jit.remote.redis_backend import RedisCache
    from opbuilder.jit.remote.tier import MAX_LOG, Tier

    store = RedisCache(server.url, prefix, 5.0)
    downloads: list[str] = []
    real_get = store.get
    monkeypatch.setattr(store, "get", lambda op, key: downloads.append(op) or real_get(op, key))
    tier = Tier(store, secrets.token_bytes(32), 1000, 5.0)
    monkeypatch.setenv("OPB_CACHE_DIR", str(tmp_path / "cache"))
    slot = cache.Slot("add_scale", "k" * 20)
    cache.ensure_dir(slot.op_dir)
    for manifest, log in ((b"{}", b"x" * (4 * MAX_LOG)), (b"{" + b" " * (4 * MAX_LOG) + b"}", b"")):
        store.put("add_scale", slot.key, remote.Entry(manifest, b"library", log, "0" * 64))
        said: list[str] = []
        assert tier.obtain(slot, lambda: slot.path, said.append) == slot.path
        assert any("refusing add_scale's entry" in line and "OPB_REMOTE_CACHE_MAX_BYTES" in line for line in said), said
    assert downloads == [], downloads

# ---- faults are not fatal ------------------------------------------------------------------------

MID_RUN = """
import importlib.util, os, signal, sys, time, torch

def load(root, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "my_ops.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    ns = module.AddScaleBuilder().load()
    return ns.add_scale(torch.arange(5, dtype=torch.float32)).tolist()

print("RESULT1", load({v1!r}, "ops_v1"), flush=True)
os.kill({pid}, signal.SIGKILL)  # the server dies in the middle of the job
time.sleep(0.3)
print("RESULT2", load({v2!r}, "ops_v2"), flush=True)
print("RESULT3", load({v3!r}, "ops_v3"), flush=True)
"""


@pytest.mark.slow
def test_redis_stopped_mid_run_ops_still_load(tmp_path: Path, built_user_op: tuple[Path, Path],
                                              own_server: RedisServer, secret: Path, prefix: str) -> None:
    env = _env(own_server, secret, prefix)
    _push(built_user_op, env)
    v2 = write_user_op(tmp_path / "v2", offset=2.0)
    v3 = write_user_op(tmp_path / "v3", offset=3.0)
    code = MID_RUN.format(v1=str(built_user_op[0]), v2=str(v2), v3=str(v3), pid=own_server.pid)
    result = run_python(code, env={**env, "OPB_CACHE_DIR": str(tmp_path / "node")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESULT1 [1.0, 3.0, 5.0, 7.0, 9.0]" in result.stdout
    assert "RESULT2 [2.0, 4.0, 6.0, 8.0, 10.0]" in result.stdout
    assert "RESULT3 [3.0, 5.0, 7.0, 9.0, 11.0]" in result.stdout
    assert result.stderr.count("opbuilder: fetched add_scale") == 1, result.stderr
    assert _builds(result.stderr) == 2, result.stderr
    # One warning line for the outage; the next op does not ask the dead server again.
    warnings = [ln for ln in result.stderr.splitlines() if "remote cache" in ln and "failed" in ln]
    assert len(warnings) == 1 and "building here" in warnings[0], result.stderr


def test_hung_redis_times_out_and_the_op_builds_here(tmp_path: Path, built_user_op: tuple[Path, Path],
                                                     own_server: RedisServer, secret: Path, prefix: str) -> None:
    env = _env(own_server, secret, prefix, OPB_REMOTE_CACHE_TIMEOUT="0.5")
    own_server.pause()
    try:
        result = run_python(load_snippet(built_user_op[0]), env={**env, "OPB_CACHE_DIR": str(tmp_path / "node")},
                            timeout=300)
    finally:
        own_server.resume()
    assert result.returncode == 0 and RESULT in result.stdout, result.stderr[-3000:]
    warnings = [ln for ln in result.stderr.splitlines() if "remote cache" in ln and "failed" in ln]
    assert len(warnings) == 1 and "Timeout" in warnings[0], result.stderr
    assert _builds(result.stderr) == 1


def test_full_redis_is_a_warning_and_the_op_builds_here(tmp_path: Path, built_user_op: tuple[Path, Path],
                                                        own_server: RedisServer, secret: Path, prefix: str) -> None:
    client = own_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")  # every write is refused: OOM
    env = _env(own_server, secret, prefix)
    result = run_python(load_snippet(built_user_op[0]), env={**env, "OPB_CACHE_DIR": str(tmp_path / "node")})
    assert result.returncode == 0 and RESULT in result.stdout, result.stderr[-3000:]
    warnings = [ln for ln in result.stderr.splitlines() if "remote cache" in ln and "failed" in ln]
    assert len(warnings) == 1 and "full (maxmemory)" in warnings[0], result.stderr
    assert _builds(result.stderr) == 1


# ---- leases --------------------------------------------------------------------------------------


def _lease_taken(server: RedisServer, prefix: str) -> bool:
    return bool(list(server.client().scan_iter(match=f"{prefix}:lease:add_scale:*")))


@contextlib.contextmanager
def _building_and_waiting(tmp_path: Path, server: RedisServer, secret: Path, prefix: str, op: Path,
                          lease: str) -> Iterator[tuple[_Child, _Child, Path]]:
    """(node 0 building ``op`` with its compiler held at the gate, node 1 waiting for that build, the gate).
    Node 0 is killed, and the gate opened, on the way out."""
    gate = tmp_path / "gate"
    gate.touch()
    env = _env(server, secret, prefix, CXX=str(_gated_cxx(tmp_path)), OPB_REMOTE_LEASE_SECONDS=lease)
    builder = _Child(load_snippet(op), {**env, "OPB_CACHE_DIR": str(tmp_path / "node0"), "OPB_TEST_GATE": str(gate)})
    try:
        _until(lambda: _lease_taken(server, prefix), 120, "the first rank to take the build lease")
        waiter = _Child(load_snippet(op), {**env, "OPB_CACHE_DIR": str(tmp_path / "node1")})
        _until(lambda: "opbuilder: waiting for" in waiter.stderr(), 120, "the second rank to wait")
        yield builder, waiter, gate
    finally:
        builder.kill()
        gate.unlink(missing_ok=True)  # a compiler that outlived its ninja would go on and end


@pytest.mark.slow
def test_lease_of_a_killed_builder_expires_and_another_rank_builds(
        tmp_path: Path, server: RedisServer, secret: Path, prefix: str) -> None:
    op = write_user_op(tmp_path / "proj")
    with _building_and_waiting(tmp_path, server, secret, prefix, op, lease="1.5") as (builder, waiter, _gate):
        builder.kill()  # kill -9 of the builder and its compilers: its lease is renewed no more
    assert waiter.wait() == 0, waiter.stderr()
    assert RESULT in waiter.out
    err = waiter.stderr()
    assert "ended without a result (its lease expired); building it here" in err, err
    assert _builds(err) == 1 and "gave up" not in err, err
    assert list(server.client().scan_iter(match=f"{prefix}:build:add_scale:*")), "the new build was shared"


@pytest.mark.slow
def test_failed_build_is_reported_to_waiters_and_a_long_build_keeps_its_lease(
        tmp_path: Path, server: RedisServer, secret: Path, prefix: str) -> None:
    op = write_user_op(tmp_path / "proj", broken=True)
    with _building_and_waiting(tmp_path, server, secret, prefix, op, lease="1") as (builder, waiter, gate):
        time.sleep(3)  # three lease lives: the builder renews its lease, nobody takes over
        assert _builds(waiter.stderr()) == 0 and "ended without" not in waiter.stderr(), waiter.stderr()
        gate.unlink()  # the compiler runs now, and fails
        assert builder.wait() != 0
    assert waiter.wait() != 0
    err = waiter.stderr()
    assert "BuildError" in err and "add_scale.cpp" in err and "error:" in err, err
    assert "while this process waited" in err, err
    assert _builds(err) == 0, err


# ---- the CLI: report, build fills, clean --remote -------------------------------------------------


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return run_module("opbuilder", *args, env={**os.environ, **env})


@pytest.mark.slow
def test_cli_build_fills_report_shows_clean_empties(server: RedisServer, secret: Path, prefix: str) -> None:
    env = _env(server, secret, prefix)
    built = _cli("build", "relu", env=env)  # the suite's shared cache: relu is usually built already
    assert built.returncode == 0, built.stderr
    assert "relu: shared in the remote cache" in built.stderr or "opbuilder: built relu" in built.stderr, built.stderr
    client = server.client()
    assert list(client.scan_iter(match=f"{prefix}:build:relu:*")), built.stderr
    again = _cli("build", "relu", env=env)
    assert "relu: already in the remote cache" in again.stderr, again.stderr

    report = _cli("report", env=env)
    assert report.returncode == 0, report.stderr
    line = next(ln for ln in report.stdout.splitlines() if ln.strip().startswith("remote cache"))
    assert server.url in line and "reachable, 1 entries" in line and prefix in line, line
    data = json.loads(_cli("report", "--json", env=env).stdout)["remote"]
    assert data["reachable"] is True and data["entries"] == 1 and data["hits"] == 0

    cleaned = _cli("clean", "--remote", env=env)
    assert cleaned.returncode == 0 and "removed 1 remote entry" in cleaned.stdout, cleaned.stdout + cleaned.stderr
    assert not list(client.scan_iter(match=f"{prefix}:*"))
    unset = _cli("clean", "--remote", env={"OPB_REMOTE_CACHE": ""})
    assert unset.returncode == 1 and "OPB_REMOTE_CACHE is not set" in unset.stderr
    down = _cli("report", env={**env, "OPB_REMOTE_CACHE": "redis://127.0.0.1:1/0", "OPB_REMOTE_CACHE_TIMEOUT": "1"})
    assert "UNREACHABLE" in down.stdout, down.stdout
