"""The Redis store of the remote tier (``pip install 'opbuilder[remote]'`` brings the ``redis`` client).

Under the prefix P (``OPB_REMOTE_CACHE_PREFIX``, default ``opbuilder:<user>``)::

    P:build:<op>:<key>    a hash: manifest, library, log, signature (written and read whole, in one command)
    P:lease:<op>:<key>    the build lease: its holder's name, with an expiry the holder renews
    P:failed:<op>:<key>   the last failed build (JSON: the compiler's error), kept an hour

One hash per artifact: an eviction (``maxmemory``) removes a whole entry, and a reader never gets the
manifest of one write with the library of another.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import urlsplit

from opbuilder.jit.remote.backend import Entry, RemoteCache, RemoteUnavailable, State

# Compare-and-act on the lease: only its holder extends or drops it.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"

_FIELDS = (b"manifest", b"library", b"log", b"signature")


def url_problem(url: str) -> str | None:
    """What makes ``url`` unparsable as host, port and database (said without any part of it); None when nothing."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError when it is no number from 0 to 65535)
    except ValueError:
        return "its host or port is malformed (a password holding '/', '?', '#' or '@' must be percent-encoded)"
    if "@" in parts.path:
        return "its database is malformed (a password holding '/' must be percent-encoded)"
    return None


def where(url: str) -> str:
    """The URL without its password, for messages. Never raises: of a malformed URL (a password holding an
    unescaped '/', whose pieces would be the port and the path) only the scheme and what parses safely show."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        scheme = re.match(r"[A-Za-z][A-Za-z0-9+.-]*(?=://)", url)
        return f"{scheme.group(0) if scheme else ''}://<malformed address>"
    if port:
        host += f":{port}"
    user = f"{parts.username}@" if parts.username else ""
    path = parts.path if re.fullmatch(r"/?[0-9]*", parts.path) else "/<malformed database>"
    return f"{parts.scheme}://{user}{host}{path}"


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisCache(RemoteCache):
    """``RemoteCache`` on one Redis server (or anything speaking its protocol)."""

    def __init__(self, url: str, prefix: str, timeout: float, password: str | None = None) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise RemoteUnavailable(
                "the redis client is not installed (pip install 'opbuilder[remote]')", down=True) from None
        self._errors = redis.exceptions
        self.where = where(url)
        self.prefix = prefix
        options: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            # One try: a slow or dead server costs one timeout, then the tier steps aside.
            "retry": Retry(NoBackoff(), 0),
        }
        if password is not None:
            options["password"] = password
        try:
            self._client = redis.Redis.from_url(url, **options)
        except ValueError as exc:
            raise RemoteUnavailable(f"OPB_REMOTE_CACHE {self.where!r} is not a Redis URL: {exc}") from None
        self._renew = self._client.register_script(_RENEW)
        self._release = self._client.register_script(_RELEASE)

    def _name(self, kind: str, op: str, key: str) -> str:
        return f"{self.prefix}:{kind}:{op}:{key}"

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._errors.OutOfMemoryError as exc:
            raise RemoteUnavailable(f"{what}: the server is full (maxmemory): {exc}", down=False) from None
        except self._errors.ResponseError as exc:
            full = str(exc).startswith("OOM")
            raise RemoteUnavailable(f"{what}: {'the server is full (maxmemory): ' if full else ''}{exc}",
                                    down=not full) from None
        except (self._errors.RedisError, OSError) as exc:
            raise RemoteUnavailable(f"{what}: {type(exc).__name__}: {exc}") from None

    def ping(self) -> None:
        self._call("ping", self._client.ping)

    def size(self, op: str, key: str) -> int | None:
        def read() -> list:
            pipe = self._client.pipeline(transaction=True)
            for field in _FIELDS:
                pipe.hstrlen(self._name("build", op, key), field)
            return pipe.execute()

        sizes = [int(n) for n in self._call("size", read)]
        return sum(sizes) if sizes[_FIELDS.index(b"library")] else None

    def get(self, op: str, key: str) -> Entry | None:
        values = self._call("download", self._client.hmget, self._name("build", op, key), list(_FIELDS))
        if all(v is None for v in values):
            return None
        manifest, library, log, signature = values
        return Entry(manifest, library, log, signature.decode("ascii", "replace") if signature is not None else None)

    def put(self, op: str, key: str, entry: Entry) -> None:
        fields = dict(zip(_FIELDS, (entry.manifest, entry.library, entry.log, entry.signature)))
        name = self._name("build", op, key)

        def write() -> None:
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(name)  # no field of an older entry stays beside the new ones
            pipe.hset(name, mapping={k: v for k, v in fields.items() if v is not None})
            pipe.delete(self._name("failed", op, key))
            pipe.execute()

        self._call("upload", write)

    def state(self, op: str, key: str) -> State:
        def read() -> list:
            pipe = self._client.pipeline(transaction=False)
            pipe.hexists(self._name("build", op, key), "library")
            pipe.get(self._name("lease", op, key))
            pipe.get(self._name("failed", op, key))
            return pipe.execute()

        has_entry, holder, failure = self._call("poll", read)
        record = None
        if failure is not None:
            try:
                record = json.loads(failure)
            except (ValueError, RecursionError):  # damaged or hostile: nested too deep to parse
                record = None
        return State(bool(has_entry), holder.decode("utf-8", "replace") if holder is not None else None,
                     record if isinstance(record, dict) else None)

    def acquire_lease(self, op: str, key: str, owner: str, seconds: float) -> bool:
        ms = max(1, int(seconds * 1000))
        return bool(self._call("lease", lambda: self._client.set(self._name("lease", op, key), owner, px=ms, nx=True)))

    def renew_lease(self, op: str, key: str, owner: str, seconds: float) -> bool:
        ms = max(1, int(seconds * 1000))
        return bool(self._call("lease renewal", lambda: self._renew(keys=[self._name("lease", op, key)], args=[owner, ms])))

    def release_lease(self, op: str, key: str, owner: str) -> None:
        self._call("lease release", lambda: self._release(keys=[self._name("lease", op, key)], args=[owner]))

    def put_failure(self, op: str, key: str, record: dict, seconds: float) -> None:
        name = self._name("failed", op, key)
        self._call("failure record", lambda: self._client.set(name, json.dumps(record), ex=max(1, int(seconds))))

    def _scan(self, pattern: str) -> list[bytes]:
        return self._call("scan", lambda: list(self._client.scan_iter(match=pattern, count=1000)))

    def remove(self, ops: list[str] | None) -> int:
        prefix = _glob_escape(self.prefix)
        patterns = [f"{prefix}:{kind}:*" for kind in ("build", "failed")] if ops is None else \
            [f"{prefix}:{kind}:{_glob_escape(op)}:*" for op in ops for kind in ("build", "failed")]
        removed = 0
        for pattern in patterns:
            names = self._scan(pattern)
            for i in range(0, len(names), 500):
                removed += int(self._call("remove", self._client.unlink, *names[i:i + 500]))
        return removed

    def count(self) -> int:
        return len(self._scan(f"{_glob_escape(self.prefix)}:build:*"))
