"""The one sequence that builds and loads an op.

try the cache -> take the lock -> try again -> build into a temporary folder -> publish with an
atomic rename -> load. The compile runs in a child process of its own process group, through
``torch.utils.cpp_extension.load``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opbuilder import cache, env, loader
from opbuilder.errors import BuildError, CacheError, CacheLockTimeout


@dataclass
class BuildSpec:
    """Everything one build needs; produced by ``OpBuilder`` and not changed afterwards."""

    op: str
    key: str
    name: str  # extension module name, unique per key
    namespace: str  # torch.ops namespace (TORCH_LIBRARY builds)
    python_module: bool
    sources: list[str]
    include_paths: list[str]
    cxx_args: list[str]
    nvcc_args: list[str]
    ldflags: list[str]
    with_cuda: bool
    archs: list[str]
    inputs: dict[str, Any] = field(default_factory=dict)


def _say(message: str) -> None:
    print(f"opbuilder: {message}", file=sys.stderr, flush=True)


def build_and_load(spec: BuildSpec) -> Any:
    """Return the loaded op, building it first when the cache has no good build of its key.

    Raises CacheError when the cache folder is unusable or unsafe, CacheLockTimeout when another
    process holds the key's lock past OPB_LOCK_TIMEOUT, BuildError when the compile fails (here or in
    the process we waited for).
    """
    handle, unloadable = loader.load_cached(spec.op, spec.key)
    if handle is not None:
        return handle
    build_dir = ensure_built(spec, reject_build_id=unloadable)
    artifact, manifest, why = cache.check_build(build_dir)
    if artifact is None or manifest is None:
        raise BuildError(f"opbuilder: the build of {spec.op} in {build_dir} is unusable: {why}")
    return loader.load_artifact(spec.op, spec.key, artifact, manifest)


def ensure_built(spec: BuildSpec, reject_build_id: str | None = None) -> Path:
    """The folder of a good build of ``spec``'s key, building it under the key's lock if needed.

    ``reject_build_id`` names a build found not to load: it is rebuilt unless another process
    already replaced it. Raises as ``build_and_load`` does.
    """
    slot = cache.Slot(spec.op, spec.key)
    if _good_build(slot, reject_build_id):
        return slot.path
    from filelock import FileLock, Timeout

    cache.ensure_dir(slot.op_dir)
    cache.check_trusted(slot)
    cache.refuse_symlink(slot.lock_path)
    lock = FileLock(str(slot.lock_path), timeout=env.lock_timeout())
    waited_since = time.time()
    try:
        try:
            lock.acquire(timeout=0)
            waited = False
        except Timeout:
            _say(f"waiting for another process building {spec.op} (lock {slot.lock_path})")
            lock.acquire()
            waited = True
    except Timeout:
        raise CacheLockTimeout(
            f"opbuilder: gave up after {env.lock_timeout():.0f} s waiting for the build lock {slot.lock_path} "
            f"of op {spec.op!r}; another process is still building it. Raise OPB_LOCK_TIMEOUT to wait longer."
        ) from None
    try:
        if _good_build(slot, reject_build_id):
            return slot.path
        failure = cache.read_failure(slot)
        if waited and failure is not None and float(failure.get("time", 0)) >= waited_since:
            raise BuildError(f"{failure.get('message')}\n(built by process {failure.get('pid')} while this one waited)")
        return _build(spec, slot)
    finally:
        lock.release()


def _good_build(slot: cache.Slot, reject_build_id: str | None) -> bool:
    artifact, manifest, _why = cache.check_build(slot.path)
    if artifact is None or manifest is None:
        return False
    if reject_build_id is not None and str(manifest.get("build_id")) == reject_build_id:
        return False
    cache.check_trusted(slot, artifact)
    return True


def _build(spec: BuildSpec, slot: cache.Slot) -> Path:
    cache.remove_stray_tmp_dirs(slot)
    tmp_dir = slot.new_tmp_dir()
    try:
        targets = "cpu" + (f" + cuda {','.join(spec.archs)}" if spec.with_cuda else "")
        _say(f"building {spec.op} ({targets}) on first use into {slot.path}")
        started = time.time()
        ok, log_text = _run_worker(spec, tmp_dir)
        seconds = time.time() - started
        if not ok:
            full = _DISK_FULL.search(log_text)
            if full:
                raise CacheError(cache.full_message(slot.op_dir, full.group(0)))
            message = _failure_message(spec, log_text)
            log_path = cache.record_failure(slot, message, log_text)
            raise BuildError(f"{message}\nfull log: {log_path}")
        artifact = tmp_dir / f"{spec.name}.so"
        if not artifact.is_file():
            raise BuildError(f"opbuilder: the build of {spec.op} finished without producing {artifact.name}")
        for leftover in list(tmp_dir.glob("*.o")) + list(tmp_dir.glob("*.spec.json")):
            leftover.unlink()
        manifest = {
            "op": spec.op,
            "key": spec.key,
            "python_module": spec.python_module,
            "module_name": spec.name,
            "namespace": spec.namespace,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "build_started": started,
            "build_seconds": round(seconds, 2),
            "build_id": uuid.uuid4().hex,
            "log": cache.LOG,
            "inputs": spec.inputs,
            **cache.describe_artifact(artifact),
        }
        try:
            published = cache.publish(slot, tmp_dir, manifest)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise CacheError(cache.full_message(slot.op_dir, os.strerror(exc.errno))) from exc
            raise
        _say(f"built {spec.op} in {seconds:.1f} s")
        return published
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _run_worker(spec: BuildSpec, tmp_dir: Path) -> tuple[bool, str]:
    spec_path = tmp_dir / f"{spec.name}.spec.json"
    payload = {**asdict(spec), "build_dir": str(tmp_dir), "parent_pid": os.getpid()}
    spec_path.write_text(json.dumps(payload))
    extra = {} if env.max_jobs() is None else {"MAX_JOBS": str(env.max_jobs())}
    log_path = tmp_dir / cache.LOG
    show = env.verbose()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "opbuilder._worker", str(spec_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env.subprocess_env(extra),
            text=True,
            errors="replace",
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if show:
                    sys.stderr.write(line)
            code = proc.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    return code == 0, log_path.read_text(errors="replace")


_DISK_FULL = re.compile(r"No space left on device|Disk quota exceeded|File too large|File size limit exceeded")
_ERROR_LINE = re.compile(r"(error|Error:|undefined reference|FAILED:)")


def _failure_message(spec: BuildSpec, log_text: str) -> str:
    lines = log_text.splitlines()
    errors = [ln for ln in lines if _ERROR_LINE.search(ln) and "error_" not in ln][:6]
    command = ""
    for i, ln in enumerate(lines):
        if ln.startswith("FAILED:") and i + 1 < len(lines):
            command = lines[i + 1].strip()
            break
    first = "\n  ".join(errors) if errors else "\n  ".join(lines[-8:])
    text = f"opbuilder: building op {spec.op!r} failed:\n  {first}"
    if command:
        text += f"\nto reproduce, run the failed command:\n  {command}"
    return text
