"""The on-disk cache: where builds live, how they are published, how a good one is recognised.

Layout under the root (``opbuilder.env.cache_root()``)::

    <op>/<key>/              a published build: the library, manifest.json, build.log
    <op>/<key>.lock          the build lock of that key (an OS lock: it dies with its holder)
    <op>/<key>.failed.json   the last failed build of that key: its error and log
    <op>/.tmp-<key>-*/       builds in progress; never loaded, removed when their builder is gone

A build becomes visible only through one atomic rename of a complete folder, so a reader sees
either nothing or a whole build with its manifest.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from opbuilder import env
from opbuilder.errors import CacheError

MANIFEST = "manifest.json"
LOG = "build.log"
TMP_PREFIX = ".tmp-"


def ensure_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) or raise CacheError naming it and the variable that moves it."""
    missing = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    try:
        for folder in reversed(missing):  # each new folder private, the root included
            folder.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise CacheError(_unusable(path, exc)) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise CacheError(_unusable(path, PermissionError(errno.EACCES, "not writable")))
    return path


def _unusable(path: Path, exc: OSError) -> str:
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    return (
        f"opbuilder cannot write its cache folder {path}: {reason}. "
        f"Point OPB_CACHE_DIR at a writable folder (now: {env.cache_root()})."
    )


def full_message(folder: Path, reason: str) -> str:
    return (
        f"opbuilder: the cache folder {folder} ran out of space while building ({reason}); nothing was "
        f"published. Free space there or point OPB_CACHE_DIR at another folder (now: {env.cache_root()})."
    )


def check_trusted(slot: "Slot", artifact: Path | None = None) -> None:
    """Refuse a cache that someone else could have written: loading from it runs their code here.

    The root, the op's folder, the build folder and the artifact must be owned by this user (or root)
    and not writable by group or others, unless OPB_TRUST_SHARED_CACHE=1. Raises CacheError.
    """
    if env.trust_shared_cache():
        return
    paths = [env.cache_root(), slot.op_dir] + ([slot.path, artifact] if artifact is not None else [])
    me = os.getuid()
    for path in paths:
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        problem = None
        if st.st_uid not in (me, 0):
            problem = f"is owned by another user (uid {st.st_uid})"
        elif st.st_mode & 0o022 and not stat.S_ISLNK(st.st_mode):
            problem = f"is writable by {'group' if st.st_mode & 0o020 else 'others'} (mode {stat.S_IMODE(st.st_mode):o})"
        if problem:
            raise CacheError(
                f"opbuilder: refusing to use {path}: it {problem}, so loading from it could run someone "
                f"else's code in this process. Use a private cache (OPB_CACHE_DIR) or, for a cache shared on "
                f"purpose, set OPB_TRUST_SHARED_CACHE=1."
            )


def refuse_symlink(path: Path) -> None:
    """A lock or record file that is a symbolic link was planted: never open through it."""
    if path.is_symlink():
        raise CacheError(
            f"opbuilder: refusing to use {path}: it is a symbolic link (to {os.readlink(path)}), which opbuilder "
            f"never creates. Remove it, and check who can write to {path.parent}."
        )


def write_text_atomic(path: Path, text: str) -> None:
    """Write a whole file or nothing: a temporary file in the same folder, then a rename."""
    ensure_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class Slot:
    """Where one op at one key lives."""

    __slots__ = ("op", "key")

    def __init__(self, op: str, key: str) -> None:
        self.op, self.key = op, key

    @property
    def op_dir(self) -> Path:
        return env.cache_root() / self.op

    @property
    def path(self) -> Path:
        return self.op_dir / self.key

    @property
    def lock_path(self) -> Path:
        return self.op_dir / f"{self.key}.lock"

    @property
    def failure_path(self) -> Path:
        return self.op_dir / f"{self.key}.failed.json"

    def new_tmp_dir(self) -> Path:
        ensure_dir(self.op_dir)
        return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{self.key}-{os.getpid()}-", dir=self.op_dir))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(build_dir: Path) -> dict | None:
    try:
        manifest = json.loads((build_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def check_build(build_dir: Path) -> tuple[Path | None, dict | None, str | None]:
    """(artifact, manifest, None) for a good build; (None, manifest or None, why) otherwise.

    Fast when nothing changed: size and mtime must match the manifest; when the mtime differs
    (the cache was copied) the file's hash decides.
    """
    manifest = read_manifest(build_dir)
    if manifest is None:
        if not build_dir.exists():
            return None, None, "not built"
        return None, None, f"manifest missing or unreadable in {build_dir}"
    try:
        artifact = build_dir / manifest["artifact"]
        size, mtime_ns, digest = manifest["artifact_size"], manifest["artifact_mtime_ns"], manifest["artifact_sha256"]
        st = artifact.stat()
    except (KeyError, TypeError):
        return None, manifest, f"manifest in {build_dir} lacks the artifact's record"
    except OSError:
        return None, manifest, f"artifact missing in {build_dir}"
    if st.st_size != size:
        return None, manifest, f"artifact {artifact} has {st.st_size} bytes, the manifest says {size}"
    if st.st_mtime_ns != mtime_ns and sha256_file(artifact) != digest:
        return None, manifest, f"artifact {artifact} does not match the hash in its manifest"
    return artifact, manifest, None


def describe_artifact(artifact: Path) -> dict[str, object]:
    st = artifact.stat()
    return {
        "artifact": artifact.name,
        "artifact_size": st.st_size,
        "artifact_mtime_ns": st.st_mtime_ns,
        "artifact_sha256": sha256_file(artifact),
    }


def publish(slot: Slot, tmp_dir: Path, manifest: dict) -> Path:
    """Write the manifest into ``tmp_dir`` and rename it to the slot. Call with the slot's lock held.

    A bad build already at the slot is moved aside first and then removed.
    """
    write_text_atomic(tmp_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    retire(slot)
    os.rename(tmp_dir, slot.path)
    with contextlib.suppress(OSError):
        slot.failure_path.unlink()
    return slot.path


def retire(slot: Slot) -> None:
    """Remove the build at ``slot``, if any. Call with the slot's lock held.

    One rename takes it out of sight first, so a reader sees a whole build or none; the deletion follows.
    """
    if not slot.path.exists():
        return
    trash = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{slot.key}-old-", dir=slot.op_dir))
    os.rename(slot.path, trash / "old")
    shutil.rmtree(trash, ignore_errors=True)


def record_failure(slot: Slot, message: str, log_text: str) -> Path:
    log_path = slot.op_dir / f"{slot.key}.failed.log"
    write_text_atomic(log_path, log_text)
    record = {"time": time.time(), "pid": os.getpid(), "message": message, "log": str(log_path)}
    write_text_atomic(slot.failure_path, json.dumps(record, indent=1))
    return log_path


def read_failure(slot: Slot) -> dict | None:
    try:
        record = json.loads(slot.failure_path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def remove_stray_tmp_dirs(slot: Slot) -> None:
    """Remove temporary build folders of this key. Call with the slot's lock held: then no live
    process is building into any of them."""
    for stray in slot.op_dir.glob(f"{TMP_PREFIX}{slot.key}-*"):
        shutil.rmtree(stray, ignore_errors=True)
