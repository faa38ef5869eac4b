"""The remote tier behind the local cache: local cache -> remote -> build, one build per cluster.

``build.ensure_built`` calls ``Tier.obtain`` with the key's local lock held (so one rank per node
talks to the store) when the local cache has no good build:

1. A stored entry is downloaded and checked: the HMAC-SHA256 signature (the cluster secret of
   ``OPB_REMOTE_CACHE_SECRET_FILE``) over the op, the key, the manifest and the library's SHA-256,
   then the manifest itself (its key, op, size and hash). A good one is written into a temporary
   folder and published with ``cache.publish``, the atomic rename of a local build, then passes
   ``cache.check_trusted`` as a local build does. A refused one is said in one line and the op is
   built here, under the key's build lease when it is free, and shared in its place (so one bad entry
   costs one build, not one per node until someone cleans it); nothing half-written is left in the local
   cache. One whose signature does not match is built here and left: that cannot tell an entry changed
   after signing from one signed with another secret (a node with another secret file, a rotation half
   done), which the nodes of the cluster's secret load; replacing it, each side would replace the other's.
2. With no entry, the rank that takes the key's build lease builds (renewing the lease while it
   compiles), publishes locally, uploads, and releases the lease. The others wait for the entry and
   download it; a failed build is handed to them with the compiler's error; a lease that expires
   without an entry (its builder died) is taken over. A rank that takes the lease looks again first:
   an entry shared between its first look and its lease (or a refused one replaced meanwhile) is
   downloaded, not built again.

The store failing (down, slow, full, evicted) is never an error: one warning line, a local build,
and the store is skipped for a while.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opbuilder import env
from opbuilder.jit import cache, fingerprint
from opbuilder.errors import BuildError
from opbuilder.jit.remote.backend import Entry, RemoteCache, RemoteUnavailable

Say = Callable[[str], None]

#: Seconds the store is left alone after it failed to answer.
COOLDOWN = 30.0
#: Seconds a failure record stays (waiters read it within a poll).
FAILURE_SECONDS = 3600.0
#: How often a waiting rank looks at the store.
POLL = 0.1
#: The most of a build log stored beside an artifact (its tail).
MAX_LOG = 1 << 20
#: What an entry of ours holds beside its library: the log (at most MAX_LOG), the manifest and the signature.
MAX_BESIDE = MAX_LOG + (1 << 20)
MIN_SECRET = 16
_SIGNED = b"opbuilder-remote-v1"

_LOCK = threading.Lock()
#: ``Tier._check``'s refusal that may be this node's doing (another secret): the entry is left (``_fetch``).
_SIGNATURE_MISMATCH = ("its signature does not match: the library, manifest or log changed after it was signed, "
                       "or it was signed with another secret than OPB_REMOTE_CACHE_SECRET_FILE's")
#: What this process did with the tier, for ``opbuilder report``.
STATS = {"hits": 0, "misses": 0, "refused": 0, "uploads": 0, "faults": 0}
_TIERS: dict[tuple, "Tier | str"] = {}


def _count(name: str) -> None:
    with _LOCK:
        STATS[name] += 1


def _fingerprint(entry: Entry) -> tuple:
    """What tells one stored entry from another: a digest of its fields, each marked present or not."""
    digest = hashlib.sha256()
    for field in (entry.manifest, entry.library, entry.log, entry.signature):
        raw = field.encode("utf-8", "replace") if isinstance(field, str) else field
        digest.update(b"-" if raw is None else b"+%d:" % len(raw) + raw)
    return ("entry", digest.hexdigest())


class Refused(Exception):
    """The tier is configured but cannot start; the message says why and what to do."""


def sign(secret: bytes, op: str, key: str, manifest: bytes, library_sha256: str, log: bytes) -> str:
    """The signature of one artifact: HMAC-SHA256 over the op, the key, the manifest's bytes, the
    library's SHA-256 and the log's."""
    payload = b"\0".join([_SIGNED, op.encode(), key.encode(), hashlib.sha256(manifest).hexdigest().encode(),
                          library_sha256.encode(), hashlib.sha256(log).hexdigest().encode()])
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def sign_failure(secret: bytes, op: str, key: str, record: dict) -> str:
    """The signature of a failure record: HMAC-SHA256 over the op, the key and the record's other fields (a
    record that anyone with write access to the store could put there would fail every waiting rank)."""
    fields = json.dumps({k: v for k, v in record.items() if k != "signature"}, sort_keys=True).encode()
    payload = b"\0".join([_SIGNED, b"failure", op.encode(), key.encode(), fields])
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def _private_file(path: Path, variable: str) -> bytes:
    """The contents of a file that only this user can read, or Refused saying what is wrong with it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise Refused(f"{variable} {path} cannot be read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{variable} {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise Refused(f"{variable} {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()})")
        if st.st_mode & 0o077:
            raise Refused(f"{variable} {path} can be read or written by others (mode {stat.S_IMODE(st.st_mode):o}); "
                          f"run chmod 600 {path}")
        return os.read(fd, 1 << 16).strip()
    finally:
        os.close(fd)


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return f"uid{os.getuid()}"


def _config() -> tuple | None:
    url = env.remote_cache_url()
    if url is None:
        return None
    return (url, env.remote_cache_secret_file(), env.remote_cache_password_file(),
            env.remote_cache_prefix() or f"opbuilder:{_user()}", env.remote_cache_max_bytes(),
            env.remote_cache_timeout(), env.remote_lease_seconds())


def where(url: str) -> str:
    """The store's address without a password."""
    from opbuilder.jit.remote.redis_backend import where as redis_where

    return redis_where(url)


def _start(config: tuple) -> Tier:
    url, secret_file, password_file, prefix, max_bytes, timeout, lease = config
    if secret_file is None:
        raise Refused(
            "OPB_REMOTE_CACHE_SECRET_FILE is not set: loading a library runs its code, so opbuilder loads from the "
            "remote cache only artifacts signed with the cluster's secret. Put one in a file only you can read "
            "(python -c 'import secrets; print(secrets.token_hex(32))' > FILE; chmod 600 FILE), the same file "
            "on every node, and point OPB_REMOTE_CACHE_SECRET_FILE at it")
    secret = _private_file(secret_file, "OPB_REMOTE_CACHE_SECRET_FILE")
    if len(secret) < MIN_SECRET:
        raise Refused(f"the secret in OPB_REMOTE_CACHE_SECRET_FILE {secret_file} has {len(secret)} bytes; use at "
                      f"least {MIN_SECRET} random ones (python -c 'import secrets; print(secrets.token_hex(32))')")
    password = None
    if password_file is not None:
        password = _private_file(password_file, "OPB_REMOTE_CACHE_PASSWORD_FILE").decode("utf-8", "replace")
    from opbuilder.jit.remote.redis_backend import RedisCache, url_problem

    if not url.startswith(("redis://", "rediss://")):
        raise Refused(f"OPB_REMOTE_CACHE must be redis://host:port/db or rediss://host:port/db, got {where(url)!r}")
    problem = url_problem(url)
    if problem is not None:
        raise Refused(f"OPB_REMOTE_CACHE must be redis://host:port/db or rediss://host:port/db, got {where(url)!r}: "
                      f"{problem}")

    try:
        store = RedisCache(url, prefix, timeout, password)
    except RemoteUnavailable as exc:
        raise Refused(str(exc)) from None
    return Tier(store, secret, max_bytes, lease)


def tier(say: Say | None = None) -> Tier | None:
    """The remote tier ``OPB_REMOTE_CACHE`` configures, or None when there is none or it cannot start
    (then ``say`` gets one line why, once per configuration). Raises ValueError for a malformed variable."""
    config = _config()
    if config is None:
        return None
    with _LOCK:
        known = _TIERS.get(config)
        if known is None:
            try:
                known = _start(config)
            except Refused as exc:
                known = str(exc)
                if say is not None:
                    say(f"remote cache {where(config[0])} not used: {known}")
            _TIERS[config] = known
    return known if isinstance(known, Tier) else None


def describe() -> dict[str, Any]:
    """The tier for ``opbuilder report``: where, whether it is used and reachable, what this process did."""
    out: dict[str, Any] = {"configured": False, "where": None, "prefix": None, "reachable": None, "why_not": None,
                           "entries": None, **STATS}
    try:
        config = _config()
    except ValueError as exc:
        out.update(configured=True, why_not=str(exc))
        return out
    if config is None:
        return out
    out.update(configured=True, where=where(config[0]), prefix=config[3])
    found = tier()
    if found is None:
        out["why_not"] = _TIERS.get(config)
        return out
    try:
        found.store.ping()
        out["entries"] = found.store.count()
        out["reachable"] = True
    except RemoteUnavailable as exc:
        out.update(reachable=False, why_not=str(exc))
    return out


class _Renewer:
    """Extends a build lease every third of its life while the build runs."""

    def __init__(self, store: RemoteCache, op: str, key: str, owner: str, seconds: float) -> None:
        self._args = (op, key, owner, seconds)
        self._store = store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"opbuilder-lease-{op}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seconds = self._args[3]
        while not self._stop.wait(seconds / 3):
            try:
                if not self._store.renew_lease(*self._args):
                    return  # lost: it expired while this process stalled (another rank may build too); go on
            except RemoteUnavailable:
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Tier:
    """The remote tier on one store, with this cluster's secret."""

    def __init__(self, store: RemoteCache, secret: bytes, max_bytes: int, lease_seconds: float) -> None:
        self.store = store
        self._secret = secret
        self._max_bytes = max_bytes
        self._lease = lease_seconds
        self._down_until = 0.0
        self._warned: set[str] = set()
        # (op, key) -> what the entry this process last refused was (_fingerprint): a rank that refused an entry
        # and then takes the lease builds only if the entry is still that one (obtain).
        self._refused: dict[tuple[str, str], tuple] = {}

    # ---- faults ------------------------------------------------------------------------------------

    def _usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def _fault(self, exc: RemoteUnavailable, what: str, say: Say) -> None:
        """One warning line per kind of fault; a store that is down is skipped for COOLDOWN seconds."""
        _count("faults")
        kind = "down" if exc.down else str(exc).split(":", 1)[0]
        if exc.down:
            self._down_until = time.monotonic() + COOLDOWN
        with _LOCK:
            if kind in self._warned:
                return
            self._warned.add(kind)
        later = f"; not asked again for {COOLDOWN:.0f} s" if exc.down else ""
        say(f"remote cache {self.store.where} failed ({exc}): {what}{later}")

    def _answered(self, say: Say) -> None:
        """The store answered: after an outage, say so once, so that the next outage is said too."""
        with _LOCK:
            if "down" not in self._warned:
                return
            self._warned.discard("down")
        say(f"remote cache {self.store.where} answers again")

    def _refuse(self, op: str, key: str, why: str, say: Say, replace: bool = True) -> None:
        _count("refused")
        say(f"remote cache: refusing {op}'s entry {key} from {self.store.where}: {why}; building it here"
            + (", to share in its place" if replace else " (the entry is left for the nodes it is good for)"))

    # ---- the sequence ------------------------------------------------------------------------------

    def obtain(self, slot: cache.Slot, build: Callable[[], Path], say: Say,
               reject_build_id: str | None = None) -> Path:
        """The folder of a good local build of ``slot``: downloaded, built here under the cluster's build
        lease and shared, or built by another rank and downloaded. Call with the slot's local lock held.

        Raises what ``build`` raises, and BuildError when the rank this one waited for failed to build.
        Never raises for the store itself: a fault there ends in ``build()``.
        """
        if not self._usable():
            return self._build_here(build)
        op, key = slot.op, slot.key
        owner = f"{socket.gethostname()} pid {os.getpid()} ({uuid.uuid4().hex[:8]})"
        try:
            found = self._fetch(slot, say, reject_build_id)
            refused = self._refused.pop((op, key), None)
            self._answered(say)
            if isinstance(found, Path):
                return found
            if found == "rejected":  # good elsewhere (it does not load here, another secret?): built here, kept
                return self._build_here(build)
            bad_entry = found == "refused"
            holders: set[str] = set()
            deadline = time.monotonic() + env.lock_timeout()
            while True:
                if self.store.acquire_lease(op, key, owner, self._lease):
                    if holders:
                        say(f"the remote build of {op} by {', '.join(sorted(holders))} ended without a result "
                            f"(its lease expired); building it here")
                    break
                if bad_entry:  # another rank builds the replacement; waiting would download the bad entry again
                    return self._build_here(build)
                found = self._wait(slot, holders, deadline, say)
                if isinstance(found, Path):
                    return found
                if found in ("refused", "rejected", "timeout"):
                    return self._build_here(build)
            # The lease is this rank's. Another rank may have shared the entry between this rank's look and its
            # lease (uploaded, then released the lease, in that window): fetched, not built again.
            try:
                found = self._since_look(slot, say, reject_build_id, refused)  # None unless this rank refused one
            except BaseException:
                self._release(op, key, owner, say)
                raise
            finally:
                self._refused.pop((op, key), None)
            if found is not None and found != "refused":  # "refused": a new bad entry, replaced under the lease
                self._release(op, key, owner, say)
                return found if isinstance(found, Path) else self._build_here(build)
        except RemoteUnavailable as exc:
            self._fault(exc, "building here", say)
            return self._build_here(build)
        return self._build_leased(slot, build, owner, say)

    def _since_look(self, slot: cache.Slot, say: Say, reject_build_id: str | None,
                    refused: tuple | None) -> Path | str | None:
        """What ``_fetch`` makes of the slot's entry now, where one is there that was not at the first look:
        None when there is none, or when it is still the one this rank refused (``refused``: its fingerprint)."""
        op, key = slot.op, slot.key
        size = self.store.size(op, key)
        if size is None or refused == ("size", size):
            return None
        if refused is not None:
            entry = self.store.get(op, key)
            if entry is None or _fingerprint(entry) == refused:
                return None
        return self._fetch(slot, say, reject_build_id)

    def _release(self, op: str, key: str, owner: str, say: Say) -> None:
        try:
            self.store.release_lease(op, key, owner)
        except RemoteUnavailable as fault:
            self._fault(fault, "its lease will expire by itself", say)

    @staticmethod
    def _build_here(build: Callable[[], Path]) -> Path:
        _count("misses")
        return build()

    def _wait(self, slot: cache.Slot, holders: set[str], deadline: float, say: Say) -> Path | str:
        """Wait while another rank holds the lease: its entry downloaded (a Path), "refused", "timeout",
        or "free" when the lease is gone without an entry. Raises BuildError when that rank's build failed."""
        op, key = slot.op, slot.key
        from opbuilder.jit import compile

        while True:
            state = self.store.state(op, key)
            if state.has_entry:
                found = self._fetch(slot, say, None)
                if found is not None:
                    return found
            failure = state.failure
            if failure is not None and not hmac.compare_digest(
                    sign_failure(self._secret, op, key, failure).encode(),
                    str(failure.get("signature")).encode("utf-8", "replace")):
                failure = None  # not one of ours (another secret, forged, damaged): wait on the lease alone
            if failure is not None and failure.get("owner") in holders:
                message = str(failure.get("message"))
                cache.record_failure(slot, message, str(failure.get("log", "")))  # this node's other ranks see it
                raise BuildError(f"{message}\n(built by {failure.get('owner')} while this process waited, "
                                 f"remote cache {self.store.where})")
            if state.lease_holder is None:
                return "free"
            if state.lease_holder not in holders:
                holders.add(state.lease_holder)
                say(f"waiting for the build of {op} by {state.lease_holder} (remote cache {self.store.where})")
            if time.monotonic() >= deadline:
                say(f"gave up after {env.lock_timeout():.0f} s waiting for {state.lease_holder} building {op} "
                    f"(OPB_LOCK_TIMEOUT); building it here")
                return "timeout"
            compile.raise_if_cancelled()
            time.sleep(POLL)

    def _build_leased(self, slot: cache.Slot, build: Callable[[], Path], owner: str, say: Say) -> Path:
        op, key = slot.op, slot.key
        renewer = None
        try:
            try:
                renewer = _Renewer(self.store, op, key, owner, self._lease)
            except RuntimeError as exc:  # no thread to be had: built all the same, the lease left to expire
                say(f"the build lease of {op} is not renewed ({exc}): a build longer than "
                    f"OPB_REMOTE_LEASE_SECONDS ({self._lease:.0f} s) may be made by another rank too")
            try:
                path = self._build_here(build)
            except BuildError as exc:
                record = cache.read_failure(slot) or {}
                log = ""
                try:
                    log = Path(str(record.get("log"))).read_text(errors="replace")[-MAX_LOG:] if record.get("log") else ""
                except OSError:
                    pass
                failure = {"owner": owner, "time": time.time(), "message": str(exc), "log": log}
                failure["signature"] = sign_failure(self._secret, op, key, failure)
                try:
                    self.store.put_failure(op, key, failure, FAILURE_SECONDS)
                except RemoteUnavailable as fault:
                    self._fault(fault, "the ranks waiting for this build are not told it failed", say)
                raise
            self._upload(slot, path, say)  # before the lease goes: a waiter then finds the entry, not a free lease
            return path
        finally:
            if renewer is not None:
                renewer.stop()
            self._release(op, key, owner, say)

    # ---- download ----------------------------------------------------------------------------------

    def _fetch(self, slot: cache.Slot, say: Say, reject_build_id: str | None) -> Path | str | None:
        """The slot's folder after a good entry was downloaded and published; "refused" when the entry is
        not good; "rejected" when it may be good elsewhere: the build ``reject_build_id`` names (it did not load
        here), or its signature does not match (another secret's, or changed after signing); None when there
        is none. Raises RemoteUnavailable, CacheError (the local cache)."""
        op, key = slot.op, slot.key
        size = self.store.size(op, key)
        if size is None:
            return None
        if size > self._max_bytes + MAX_BESIDE:  # asked before the download: a huge log or manifest stays there
            self._refuse(op, key, f"it has {size} bytes, over OPB_REMOTE_CACHE_MAX_BYTES ({self._max_bytes}) for "
                                  f"its library and {MAX_BESIDE} for the rest", say)
            self._refused[(op, key)] = ("size", size)
            return "refused"
        entry = self.store.get(op, key)
        if entry is None:  # removed or evicted since
            return None
        manifest, why = self._check(op, key, entry)
        if manifest is None or why is not None:
            other_secret = why == _SIGNATURE_MISMATCH
            self._refuse(op, key, why or "unusable", say, replace=not other_secret)
            if other_secret:
                return "rejected"
            self._refused[(op, key)] = _fingerprint(entry)
            return "refused"
        if reject_build_id is not None and str(manifest.get("build_id")) == reject_build_id:
            say(f"the remote build of {op} ({reject_build_id}) does not load here; building it here")
            return "rejected"
        started = time.monotonic()
        path = self._publish(slot, manifest, entry)
        _count("hits")
        say(f"fetched {op} from the remote cache {self.store.where} ({len(entry.library or b'')} bytes, "
            f"{time.monotonic() - started:.2f} s to publish; built in {manifest.get('build_seconds')} s)")
        return path

    def _check(self, op: str, key: str, entry: Entry) -> tuple[dict | None, str | None]:
        """(the manifest, None) when the entry is signed with our secret and describes this very key and
        library; (None, why) otherwise."""
        for field in ("manifest", "library", "signature"):
            if getattr(entry, field) is None:
                return None, f"it has no {field} (unsigned, evicted or half-written)"
        assert entry.manifest is not None and entry.library is not None and entry.signature is not None
        if len(entry.library) > self._max_bytes:
            return None, f"its library has {len(entry.library)} bytes, over OPB_REMOTE_CACHE_MAX_BYTES"
        library_sha = hashlib.sha256(entry.library).hexdigest()
        expected = sign(self._secret, op, key, entry.manifest, library_sha, entry.log or b"")
        if not hmac.compare_digest(expected.encode(), entry.signature.encode("utf-8", "replace")):  # any bytes
            return None, _SIGNATURE_MISMATCH
        try:
            manifest = json.loads(entry.manifest)
        except ValueError:
            return None, "its manifest is not JSON"
        if not isinstance(manifest, dict):
            return None, "its manifest is not a JSON object"
        problem = cache.manifest_problem(manifest)
        if problem is not None:
            return None, f"its manifest is damaged: {problem}"
        inputs = manifest.get("inputs")
        checks = (
            (manifest.get("op") == op, f"its manifest is of op {manifest.get('op')!r}"),
            (manifest.get("key") == key, f"its manifest is of key {manifest.get('key')!r}"),
            (isinstance(inputs, dict) and fingerprint.cache_key(inputs) == key, "its manifest's inputs are of another key"),
            (manifest["artifact_sha256"] == library_sha, "its library does not match the manifest's hash"),
            (manifest["artifact_size"] == len(entry.library), "its library does not have the manifest's size"),
        )
        for ok, why in checks:
            if not ok:
                return None, why
        return manifest, None

    def _publish(self, slot: cache.Slot, manifest: dict, entry: Entry) -> Path:
        """Write the checked entry into a temporary folder and publish it as a local build does."""
        cache.remove_stray_tmp_dirs(slot)
        tmp_dir = slot.new_tmp_dir()
        try:
            artifact = tmp_dir / manifest["artifact"]
            try:
                fd = os.open(artifact, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o755)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(entry.library or b"")
                (tmp_dir / cache.LOG).write_bytes(entry.log or b"")
                cache.share(tmp_dir / cache.LOG)
                local = {**manifest, **cache.describe_artifact(artifact), "log": cache.LOG,
                         "remote": {"from": self.store.where, "fetched_at": time.time()}}
                if local["artifact_sha256"] != manifest["artifact_sha256"]:
                    raise OSError(f"{artifact} differs from what was downloaded")
                published = cache.publish(slot, tmp_dir, local)
            except OSError as exc:
                raise cache.cache_error(tmp_dir, exc) from exc
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        cache.check_trusted(slot, published / manifest["artifact"])
        return published

    # ---- upload ------------------------------------------------------------------------------------

    def push(self, slot: cache.Slot, say: Say, replace: bool = True) -> str:
        """Share the good local build of ``slot``; returns what was done, in words. ``replace=False``
        leaves an entry that is already there. Never raises for the store (a fault is said)."""
        if not self._usable():
            return "not shared: the remote cache is unreachable"
        try:
            if not replace and self.store.size(slot.op, slot.key) is not None:
                return f"already in the remote cache {self.store.where}"
        except RemoteUnavailable as exc:
            self._fault(exc, "nothing shared", say)
            return f"not shared: {exc}"
        return self._upload(slot, slot.path, say)

    def _upload(self, slot: cache.Slot, path: Path, say: Say) -> str:
        artifact, manifest, why = cache.check_build(path)
        if artifact is None or manifest is None:
            return f"not shared: {why}"
        if manifest["artifact_size"] > self._max_bytes:
            message = (f"not shared: its library has {manifest['artifact_size']} bytes, over "
                       f"OPB_REMOTE_CACHE_MAX_BYTES ({self._max_bytes})")
            say(f"{slot.op}: {message}")
            return message
        try:
            library = artifact.read_bytes()
            log = (path / cache.LOG).read_bytes()[-MAX_LOG:] if (path / cache.LOG).is_file() else b""
        except OSError as exc:
            return f"not shared: {exc}"
        library_sha = hashlib.sha256(library).hexdigest()
        if library_sha != manifest["artifact_sha256"]:
            return "not shared: the library does not match its manifest"
        shared = {k: v for k, v in manifest.items() if k != "remote"}
        blob = json.dumps(shared, indent=1, sort_keys=True).encode()
        entry = Entry(blob, library, log, sign(self._secret, slot.op, slot.key, blob, library_sha, log))
        try:
            self.store.put(slot.op, slot.key, entry)
        except RemoteUnavailable as exc:
            self._fault(exc, f"{slot.op} is not shared (it is built and cached here)", say)
            return f"not shared: {exc}"
        _count("uploads")
        return f"shared in the remote cache {self.store.where}"

    def clean(self, ops: list[str] | None) -> int:
        """Remove this user's entries (of ``ops``, or all); never a lease. Raises RemoteUnavailable."""
        return self.store.remove(ops)
