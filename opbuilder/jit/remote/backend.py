"""What a remote cache store must do: ``RemoteCache``, small enough for an S3 or HTTP backend to follow.

A store keeps bytes and leases; it trusts nothing and decides nothing. Signing, checking and
publishing into the local cache are the tier's (``opbuilder.jit.remote.tier``), the same for every store.
Every method raises ``RemoteUnavailable`` when the store cannot answer (down, slow, full, refused):
the tier turns that into one warning line and a local build, never an error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


class RemoteUnavailable(Exception):
    """The store did not answer as asked. ``down``: it cannot be reached at all (skip it for a while),
    as opposed to a refused write (full) after which reads still work."""

    def __init__(self, message: str, down: bool = True) -> None:
        super().__init__(message)
        self.down = down


@dataclass
class Entry:
    """One artifact as stored: the manifest's JSON bytes, the library, the build log, and the signature
    (hex HMAC-SHA256). A field is None when the store had none (a damaged or half-evicted entry)."""

    manifest: bytes | None
    library: bytes | None
    log: bytes | None
    signature: str | None


@dataclass
class State:
    """What waiting for another rank's build looks at, read in one round trip."""

    has_entry: bool
    lease_holder: str | None
    failure: dict | None


class RemoteCache(ABC):
    """A store of built artifacts by (op, key), with build leases and failure records."""

    #: Where it is, for messages and ``opbuilder report``: never a password.
    where: str
    #: Where this user's entries live in the store (a key prefix, a bucket folder).
    prefix: str

    @abstractmethod
    def ping(self) -> None:
        """Return when the store answers; raise RemoteUnavailable otherwise."""

    @abstractmethod
    def size(self, op: str, key: str) -> int | None:
        """Bytes of the stored entry of (op, key), every field together (what ``get`` would download), or None
        when it has no library."""

    @abstractmethod
    def get(self, op: str, key: str) -> Entry | None:
        """The entry of (op, key) read at once (never parts of two writes), or None when there is none."""

    @abstractmethod
    def put(self, op: str, key: str, entry: Entry) -> None:
        """Store ``entry`` whole, replacing any entry of (op, key), and forget the key's failure record."""

    @abstractmethod
    def state(self, op: str, key: str) -> State:
        """Whether (op, key) has an entry, who holds its build lease, its failure record."""

    @abstractmethod
    def acquire_lease(self, op: str, key: str, owner: str, seconds: float) -> bool:
        """Take the build lease of (op, key) for ``seconds`` if nobody holds it; True when taken."""

    @abstractmethod
    def renew_lease(self, op: str, key: str, owner: str, seconds: float) -> bool:
        """Extend ``owner``'s lease to ``seconds`` from now; False when ``owner`` no longer holds it."""

    @abstractmethod
    def release_lease(self, op: str, key: str, owner: str) -> None:
        """Drop the lease if ``owner`` still holds it (never another's)."""

    @abstractmethod
    def put_failure(self, op: str, key: str, record: dict, seconds: float) -> None:
        """Record a failed build of (op, key) for ``seconds``, for the ranks that wait for it."""

    @abstractmethod
    def remove(self, ops: list[str] | None) -> int:
        """Remove the entries and failure records of ``ops`` (all when None) under this user's prefix,
        never a lease (a build in progress); returns how many keys went."""

    @abstractmethod
    def count(self) -> int:
        """How many entries are stored under this user's prefix."""
