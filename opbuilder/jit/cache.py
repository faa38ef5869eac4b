"""The on-disk cache: where builds live, how they are published, how a good one is recognised.

Where everything lies is ``opbuilder.paths`` (its docstring lists every entry of the cache).

A build becomes visible only through one atomic rename of a complete folder, so a reader sees
either nothing or a whole build with its manifest.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from opbuilder import env, paths
from opbuilder.errors import CacheError
from opbuilder.paths import LOG, MANIFEST, TMP_PREFIX

__all__ = ["LOG", "MANIFEST", "TMP_PREFIX", "Slot"]  # the entries' names, as the cache's users know them


def ensure_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700; in a shared cache as the umask allows) or raise CacheError naming
    it and the variable that moves it."""
    missing = []
    probe = path
    try:
        while not probe.exists() and probe != probe.parent:
            missing.append(probe)
            probe = probe.parent
        if not env.trust_shared_cache() and path.is_relative_to(env.cache_root()):
            check_chain(probe)  # nothing is written into a cache that would be refused at load
        for folder in reversed(missing):  # each new folder private (the root included) unless shared
            folder.mkdir(mode=0o777 if env.trust_shared_cache() else 0o700, exist_ok=True)
    except OSError as exc:  # a folder, though one that could not be made is not there to be seen as one
        raise CacheError(_unusable(path, exc, folder=True)) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        code = errno.EROFS if _read_only(path) else errno.EACCES
        raise CacheError(_unusable(path, OSError(code, os.strerror(code)), folder=True))
    return path


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _is_folder(path: Path, folder: bool | None) -> bool:
    """``folder`` where the caller knows (a folder that could not be made is not there to be seen), else whether
    ``path`` is one (os.path.isdir: no stat error raised while an error is being reported)."""
    return os.path.isdir(path) if folder is None else folder


def _what(path: Path, cache: str = "the cache", folder: bool | None = None) -> str:
    """``path`` as the messages name it: a folder of the cache, or a file in it."""
    return f"{cache} {'folder' if _is_folder(path, folder) else 'file'} {path}"


def _unusable(path: Path, exc: OSError, folder: bool | None = None) -> str:
    if exc.errno in _FULL:
        return full_message(path, os.strerror(exc.errno), folder)
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    if exc.errno in (errno.EACCES, errno.EPERM) and env.trust_shared_cache():
        return (
            f"opbuilder cannot use {_what(path, 'the shared cache', folder)}: {reason} for user "
            f"{_user()}. Ask the cache's "
            f"owner to let this user's group write there (chgrp -R GROUP {env.cache_root()} && chmod -R g+rwX,g+s "
            f"on its folders, builds under umask 002), or point OPB_CACHE_DIR at a cache of your own."
        )
    return (
        f"opbuilder cannot write {_what(path, folder=folder)}: {reason}. "
        f"Point OPB_CACHE_DIR at a writable folder (now: {env.cache_root()})."
    )


def _user() -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(os.getuid()).pw_name} (uid {os.getuid()})"
    except (ImportError, KeyError):
        return f"uid {os.getuid()}"


#: errno values that mean the disk (or the user's quota, or the file size limit) is full.
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def cache_error(path: Path, exc: OSError, folder: bool | None = None) -> CacheError:
    """The CacheError for an OSError met writing or reading ``path`` in the cache: a full disk, a
    read-only one, a folder this user may not use (in a shared cache: what its owner must change).
    ``folder``: whether ``path`` is a folder, where the caller knows (else whether one is there)."""
    return CacheError(_unusable(path, exc, folder))


def full_message(path: Path, reason: str, folder: bool | None = None) -> str:
    """The message of a full disk met writing ``path`` (a folder of the cache, or a file in it)."""
    full = f"the cache folder {path} ran out of space" if _is_folder(path, folder) else \
        f"the cache ran out of space writing {path}"
    return (
        f"opbuilder: {full} ({reason}); nothing was "
        f"published. Free space there or point OPB_CACHE_DIR at another folder (now: {env.cache_root()})."
    )


def _umask() -> int:
    try:  # read, not set: os.umask() would change it for a moment for every thread
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def share(path: Path, folder: bool = False) -> None:
    """In a shared cache, give ``path`` the mode a plain ``open``/``mkdir`` would have had under the
    umask (tempfile makes 0600 files and 0700 folders): the cache's other users must read it."""
    if env.trust_shared_cache():
        os.chmod(path, (0o777 if folder else 0o666) & ~_umask())


def lock_mode() -> int:
    """The mode of a new lock file: in a shared cache the group's to take whatever the umask (others as it
    allows). A lock file holds nothing and is never replaced: one made 0644 by a process run once under umask 022
    would refuse every later writer of its key in the group, for good, where its other files are replaced."""
    return (0o660 | (0o666 & ~_umask())) if env.trust_shared_cache() else 0o644


def _refuse(path: str | Path, problem: str) -> CacheError:
    return CacheError(
        f"opbuilder: refusing to use {path}: it {problem}, so loading from it could run someone "
        f"else's code in this process. Use a private cache (OPB_CACHE_DIR) or, for a cache shared on "
        f"purpose, set OPB_TRUST_SHARED_CACHE=1."
    )


def trust_problem(st: os.stat_result) -> str | None:
    """Why a file or folder with this status could have been written by someone else; None if it could not.

    Owned by this user or root, and not writable by group or others; a folder writable by others
    passes when it is sticky (as /tmp): then only an entry's owner can rename or remove it.
    """
    if st.st_uid not in (os.getuid(), 0):
        return f"is owned by another user (uid {st.st_uid})"
    if st.st_mode & 0o022 and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        who = " and ".join(name for bit, name in ((0o020, "group"), (0o002, "others")) if st.st_mode & bit)
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


_MAX_LINKS = 40  # as the kernel's own limit on symbolic links in one lookup


def _lookup_chain(path: Path) -> list[tuple[str, os.stat_result]]:
    """Every entry the kernel passes through to reach ``path``: each folder from ``/`` down, and the
    folders of every symbolic link's target on the way, in order, with its ``lstat``. A link itself
    is not listed (its mode means nothing; who can replace it is decided by its folder, listed).

    Stops at the first entry that does not exist. The last entry is ``path`` itself unless it is a link.
    """
    text = os.fspath(path)
    if not text.startswith("/"):
        text = os.path.join(os.getcwd(), text)
    pending = [part for part in text.split("/") if part not in ("", ".")]
    current = "/"
    chain = [(current, os.lstat(current))]
    links = 0
    while pending:
        part = pending.pop(0)
        if part == "..":  # ``current`` has no links left in it, so its parent is the real one
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        try:
            st = os.lstat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            break
        except OSError as exc:  # a folder on the way this user cannot search
            raise cache_error(Path(candidate), exc) from exc
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise CacheError(f"opbuilder: cannot use {path}: too many levels of symbolic links")
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = "/"
            pending = [p for p in target.split("/") if p not in ("", ".")] + pending
            continue
        chain.append((candidate, st))
        current = candidate
    return chain


def chain_problem(path: Path) -> str | None:
    """Why someone other than this user (or root) could have put ``path`` there: the path itself or a
    folder on the way to it, through symbolic links, fails ``trust_problem``; None when none does.
    Parts of ``path`` that do not exist yet are not checked (there is nothing to load from them)."""
    for entry, st in _lookup_chain(path):
        problem = trust_problem(st)
        if problem is not None:
            return f"{entry} {problem}"
    return None


def check_chain(path: Path) -> None:
    """Raise CacheError when ``chain_problem(path)`` finds one."""
    for entry, st in _lookup_chain(path):
        problem = trust_problem(st)
        if problem is not None:
            raise _refuse(entry, problem)


def check_trusted(slot: "Slot", artifact: Path | None = None) -> None:
    """Refuse a cache that someone else could have written: loading from it runs their code here.

    The artifact, its build folder, the op's folder, the root and every folder above the root (symbolic
    links followed, their targets checked too) must be owned by this user (or root) and not writable
    by group or others (sticky folders such as /tmp aside), unless OPB_TRUST_SHARED_CACHE=1. An
    artifact that is a symbolic link is refused even then: opbuilder never makes one. Raises CacheError.
    """
    if artifact is not None and artifact.is_symlink():
        raise _refuse(artifact, f"is a symbolic link (to {os.readlink(artifact)}), which opbuilder never creates")
    if env.trust_shared_cache():
        return
    check_chain(artifact if artifact is not None else slot.op_dir)


def refuse_symlink(path: Path) -> None:
    """A lock or record file that is a symbolic link was planted: never open through it."""
    if path.is_symlink():
        raise CacheError(
            f"opbuilder: refusing to use {path}: it is a symbolic link (to {os.readlink(path)}), which opbuilder "
            f"never creates. Remove it, and check who can write to {path.parent}."
        )


def write_text_atomic(path: Path, text: str, private: bool = False) -> None:
    """Write a whole file or nothing: a temporary file in the same folder, then a rename.

    ``private``: readable by this user alone (mode 0600, in a shared cache too), written only into a folder
    that exists already (a file only this user reads back, such as the key's memo).
    Raises CacheError when the disk is full, read-only, or the folder not ours to write.
    """
    if not private:
        ensure_dir(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    except OSError as exc:
        raise cache_error(path.parent, exc, folder=True) from exc
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        if not private:
            share(Path(tmp))
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise cache_error(path, exc) from exc
        raise


class Slot:
    """Where one op at one key lives."""

    __slots__ = ("op", "key")

    def __init__(self, op: str, key: str) -> None:
        self.op, self.key = op, key

    @property
    def op_dir(self) -> Path:
        return paths.op_dir(self.op)

    @property
    def path(self) -> Path:
        return paths.build_dir(self.op, self.key)

    @property
    def lock_path(self) -> Path:
        return paths.lock(self.op, self.key)

    @property
    def failure_path(self) -> Path:
        return paths.failure(self.op, self.key)

    def new_tmp_dir(self) -> Path:
        ensure_dir(self.op_dir)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{self.key}-{os.getpid()}-", dir=self.op_dir))
        except OSError as exc:
            raise cache_error(self.op_dir, exc) from exc
        share(tmp, folder=True)  # it becomes the published build folder
        return tmp


def sha256_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return _sha256_fd(fh.fileno())


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    offset = 0
    while block := os.pread(fd, 1 << 20, offset):
        h.update(block)
        offset += len(block)
    return h.hexdigest()


#: The most a cache record (a manifest, a failure record, discovered.json) is read to: far more than ours take.
MAX_RECORD_BYTES = 16 << 20


def read_record(path: Path) -> str:
    """The text of a small cache record, opened without following a link or waiting on a FIFO (a shared cache's
    files are read before the trust checks would refuse them). Raises OSError when it is not a regular file
    of at most MAX_RECORD_BYTES, PermissionError when this user may not read it, ValueError when not UTF-8."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RECORD_BYTES:
            raise OSError(errno.EINVAL, "not a regular file of a record's size", str(path))
        return fh.read(MAX_RECORD_BYTES + 1).decode("utf-8")


def read_manifest(build_dir: Path) -> dict | None:
    """The manifest of ``build_dir`` as a dict, or None when it is missing or not JSON.

    Raises CacheError when it is there but this user may not read it (a shared cache's permissions).
    """
    path = build_dir / MANIFEST
    try:
        manifest = json.loads(read_record(path))
    except PermissionError as exc:
        raise cache_error(path, exc) from exc
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def manifest_problem(manifest: dict) -> str | None:
    """What makes a parsed manifest unusable (a field missing or of the wrong type); None when none."""
    name = manifest.get("artifact")
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name:
        return f"its artifact entry {name!r} is not a file name"
    for field in ("artifact_size", "artifact_mtime_ns"):
        value = manifest.get(field)
        if type(value) is not int or value < 0:
            return f"its {field} {value!r} is not a non-negative integer"
    digest = manifest.get("artifact_sha256")
    if not isinstance(digest, str) or len(digest) != 64:
        return f"its artifact_sha256 {digest!r} is not a sha256"
    python_module = manifest.get("python_module", False)
    if not isinstance(python_module, bool):
        return f"its python_module {python_module!r} is not true or false"
    field = "module_name" if python_module else "namespace"
    if not isinstance(manifest.get(field), str) or not manifest[field].isidentifier():
        return f"its {field} {manifest.get(field)!r} is not a name"
    return None


def check_build(build_dir: Path) -> tuple[Path | None, dict | None, str | None]:
    """(artifact, manifest, None) for a good build; (None, manifest or None, why) otherwise.

    Fast when nothing changed: size and mtime must match the manifest; when the mtime differs
    (the cache was copied) the file's hash decides. A manifest with a field missing or of the wrong
    type is a bad build (rebuilt), never an exception. Raises CacheError when this user may not read
    the build (see ``read_manifest``).
    """
    manifest = read_manifest(build_dir)
    if manifest is None:
        try:
            if not build_dir.exists():
                return None, None, "not built"
        except OSError as exc:  # no permission to look, or a name too long for the filesystem (ENAMETOOLONG)
            raise cache_error(build_dir, exc, folder=True) from exc
        return None, None, f"manifest missing or unreadable in {build_dir}"
    problem = manifest_problem(manifest)
    if problem is not None:
        return None, manifest, f"the manifest in {build_dir} is damaged: {problem}"
    artifact = build_dir / manifest["artifact"]
    size, mtime_ns, digest = manifest["artifact_size"], manifest["artifact_mtime_ns"], manifest["artifact_sha256"]
    try:
        st = artifact.stat()
    except PermissionError as exc:
        raise cache_error(artifact, exc) from exc
    except OSError:
        return None, manifest, f"artifact missing in {build_dir}"
    if not stat.S_ISREG(st.st_mode):
        return None, manifest, f"artifact {artifact} is not a file"
    if st.st_size != size:
        return None, manifest, f"artifact {artifact} has {st.st_size} bytes, the manifest says {size}"
    if st.st_mtime_ns != mtime_ns and sha256_file(artifact) != digest:
        return None, manifest, f"artifact {artifact} does not match the hash in its manifest"
    return artifact, manifest, None


def open_artifact(artifact: Path, manifest: dict) -> int:
    """Open ``artifact`` for loading and check the open file: the caller loads this very file
    (through ``/proc/self/fd/N``), so swapping the folder or the file after the check changes nothing.

    Never follows a symbolic link. The open file must be a regular file of this user or root, not
    writable by others (unless OPB_TRUST_SHARED_CACHE=1), of the manifest's size and (when its mtime
    differs) hash. Returns the descriptor (close-on-exec). Raises CacheError when it is not safe to
    load, OSError when it is gone or no longer the file the manifest describes (a bad build).
    """
    try:
        fd = os.open(artifact, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(artifact, "is a symbolic link, which opbuilder never creates") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise cache_error(artifact, exc) from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(artifact))
        problem = None if env.trust_shared_cache() else trust_problem(st)
        if problem is not None:
            raise _refuse(artifact, problem)
        if st.st_size != manifest["artifact_size"] or (
            st.st_mtime_ns != manifest["artifact_mtime_ns"] and _sha256_fd(fd) != manifest["artifact_sha256"]
        ):
            raise OSError(errno.ESTALE, "changed since its manifest was written", str(artifact))
    except BaseException:
        os.close(fd)
        raise
    return fd


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
    log_path = paths.failure_log(slot.op, slot.key)
    write_text_atomic(log_path, log_text)
    record = {"time": time.time(), "pid": os.getpid(), "message": message, "log": str(log_path)}
    write_text_atomic(slot.failure_path, json.dumps(record, indent=1))
    return log_path


def read_failure(slot: Slot) -> dict | None:
    """The failure record of ``slot``, or None. Its ``time`` is a finite float or None (a record
    written by hand or damaged), its ``message`` a string."""
    try:
        record = json.loads(read_record(slot.failure_path))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    when = record.get("time")
    valid = isinstance(when, (int, float)) and not isinstance(when, bool) and math.isfinite(when)
    record["time"] = float(when) if valid else None
    record["message"] = str(record.get("message") or "opbuilder: the build failed (its record gives no message)")
    return record


def remove_stray_tmp_dirs(slot: Slot) -> None:
    """Remove temporary build folders of this key. Call with the slot's lock held: then no live
    process is building into any of them."""
    for stray in slot.op_dir.glob(f"{TMP_PREFIX}{slot.key}-*"):
        shutil.rmtree(stray, ignore_errors=True)
