"""Every environment variable opbuilder reads, in one place.

Values are read at call time, never cached at import, so a test or a launcher can change them
between calls. Nothing here writes to ``os.environ``.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from opbuilder.errors import EnvError

#: Variables opbuilder reads, with what they do; the README's table is generated from the same facts.
VARIABLES: dict[str, str] = {
    "OPB_CACHE_DIR": "Root of the JIT cache (default: $XDG_CACHE_HOME/opbuilder where that is an absolute path, else ~/.cache/opbuilder).",
    "OPB_LOCK_TIMEOUT": "Seconds to wait for another process's build of the same op before failing (default 600).",
    "OPB_VERBOSE": "1 shows the compiler's output while building.",
    "OPB_MAX_JOBS": "Parallel compile jobs inside one build (default: the cores, shared among the builds running at once).",
    "OPB_CPU_ARCH": "Value for -march on CPU code (default 'native' for JIT builds; 'none' omits it).",
    "OPB_TRUST_SHARED_CACHE": "1 loads from a cache that other users own or can write to (a deliberately shared cache).",
    "OPB_FALLBACK": "0 makes an op that cannot be built or loaded here an error, instead of falling back to the next implementation (default 1).",
    "OPB_CXX_AUTOGRAD": "0 records the built-in ops' gradients through Python autograd.Functions instead of their C++ path (default 1: the C++ glue, built once a torch version, in the background when first needed).",
    "OPB_COMPILE_INLINE_BELOW": "Under torch.compile, a built-in op's call on fewer elements than this traces the op's PyTorch definition, which Inductor fuses with its neighbours, instead of calling our kernel (default 2097152; 0: our kernel at every size). Read when a model is compiled.",
    "OPB_BUILD_OPS": "1 at install time prebuilds every compatible built-in op.",
    "OPB_BUILD_<OP>": "1 prebuilds one op at install time, 0 excludes it.",
    "DS_BUILD_OPS": "1 makes opbuilder.deepspeed.prebuild() compile every DeepSpeed-style op it is given that can be built here.",
    "DS_BUILD_<OP>": "A DeepSpeed builder's BUILD_VAR: 1 makes opbuilder.deepspeed.prebuild() compile that op, 0 excludes it (OPB_BUILD_<OP> wins when both are set).",
    "TORCH_CUDA_ARCH_LIST": "CUDA archs to build for, e.g. '9.0' or '8.0;9.0+PTX' (default: the visible GPUs).",
    "CUDA_HOME": "CUDA toolkit root (else CUDA_PATH, else the folder of nvcc on PATH, else /usr/local/cuda).",
    "CXX": "Host C++ compiler (default c++), as torch.utils.cpp_extension uses it.",
    "CC": "nvcc's host compiler (-ccbin), as torch.utils.cpp_extension uses it; part of the cache key.",
    "PYTORCH_NVCC": "The nvcc command torch.utils.cpp_extension runs instead of $CUDA_HOME/bin/nvcc; part of the key.",
    "OPB_DEBUG": "1 builds with debug info (host -g, device -lineinfo) into its own key; 'device' adds nvcc -G; 0 builds without any, even where an op's own flags ask for it (DeepSpeed's CPU builders pass -g).",
    "LD_LIBRARY_PATH": "Read (never set) to find the OpenMP runtime torch's library links, as the dynamic loader does.",
    "CPATH": "Read (never set): folders the compilers search for headers; part of the cache key (a switch rebuilds).",
    "C_INCLUDE_PATH": "Read (never set): as CPATH, for C; part of the cache key.",
    "CPLUS_INCLUDE_PATH": "Read (never set): as CPATH, for C++; part of the cache key.",
    "OPB_REMOTE_CACHE": "A remote cache tier shared by the nodes of a cluster: redis://[user:password@]host:port/db or rediss:// (TLS); unset: none.",
    "OPB_REMOTE_CACHE_SECRET_FILE": "File (readable by you alone) holding the cluster's secret that signs and checks remote artifacts; without it the remote tier is not used.",
    "OPB_REMOTE_CACHE_PASSWORD_FILE": "File (readable by you alone) holding the Redis password, instead of one in the URL.",
    "OPB_REMOTE_CACHE_PREFIX": "Prefix of opbuilder's keys in Redis (default opbuilder:<user>); ranks share builds under one prefix.",
    "OPB_REMOTE_CACHE_MAX_BYTES": "Largest library shared through the remote tier, in bytes (default 268435456, 256 MiB).",
    "OPB_REMOTE_CACHE_TIMEOUT": "Seconds one remote cache request may take before the tier is skipped with a warning (default 5; at most 86400).",
    "OPB_REMOTE_LEASE_SECONDS": "Life of a remote build lease, renewed while the build runs: how soon another rank takes over a dead builder's build (default 30; at most 86400).",
}

#: The variables through which the compilers find headers that no flag names.
INCLUDE_PATH_VARIABLES = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _flag(name: str, default: bool = False) -> bool:
    """A yes/no variable: unset or blank is ``default``; 1/true/yes/on or 0/false/no/off (any case, spaces around
    ignored), or a whole number (0 no, any other yes). Anything else is refused, naming the variable: read as
    "yes", a misspelt "off" (" 0", "disable") would turn on what it meant to turn off."""
    raw = _get(name)
    value = "" if raw is None else raw.strip().lower()
    if value == "":
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    if re.fullmatch(r"[+-]?[0-9]+", value):
        return value.lstrip("+-").strip("0") != ""  # a whole number: 0 is no (no int(): any length)
    raise EnvError(f"{name} must be 1 (or true, yes, on) or 0 (or false, no, off), got {raw!r}")


def _whole(raw: str) -> int | None:
    """``raw`` as a whole number (ASCII digits alone: str.isdigit() also takes '²', which int() refuses), None when it
    is not one. No int() of any length (Python refuses more than 4300 digits): one past 2**63 counts as 2**63."""
    if not (raw.isascii() and raw.isdigit()):
        return None
    digits = raw.lstrip("0") or "0"
    return int(digits) if len(digits) <= 19 else 1 << 63


def cache_root() -> Path:
    # Absolute (from the working folder) when given relative: builds run in folders of their own.
    explicit = _get("OPB_CACHE_DIR")
    if explicit is not None:
        return Path(os.path.abspath(Path(explicit).expanduser()))
    xdg = _get("XDG_CACHE_HOME")
    if xdg is not None and Path(xdg).expanduser().is_absolute():  # a relative one is invalid: ignored (XDG spec)
        base = Path(xdg).expanduser()
    else:
        try:
            base = Path.home() / ".cache"
        except (RuntimeError, KeyError):  # no HOME and no passwd entry (a container's arbitrary uid)
            raise EnvError(f"opbuilder cannot find a cache folder: OPB_CACHE_DIR, XDG_CACHE_HOME and HOME are not set "
                           f"and uid {os.getuid()} has no home folder; set OPB_CACHE_DIR") from None
    return Path(os.path.abspath(base / "opbuilder"))


def lock_timeout() -> float:
    raw = _get("OPB_LOCK_TIMEOUT")
    if raw is None:
        return 600.0
    try:
        value = float(raw)
    except ValueError:
        raise EnvError(f"OPB_LOCK_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if not math.isfinite(value) or value < 0:  # nan would never time out
        raise EnvError(f"OPB_LOCK_TIMEOUT must be a finite number of seconds >= 0, got {raw!r}")
    return value


def verbose() -> bool:
    return _flag("OPB_VERBOSE")


#: The most compilers OPB_MAX_JOBS may ask for (ninja's -j takes an int; no machine has more cores).
MAX_JOBS_LIMIT = 4096


def max_jobs() -> int | None:
    raw = _get("OPB_MAX_JOBS")
    if raw is None:
        return None
    value = _whole(raw)
    if value is None or not 1 <= value <= MAX_JOBS_LIMIT:
        raise EnvError(f"OPB_MAX_JOBS must be a whole number from 1 to {MAX_JOBS_LIMIT}, got {raw!r}")
    return value


def cpu_arch() -> str | None:
    raw = _get("OPB_CPU_ARCH") or "native"
    return None if raw.lower() == "none" else raw


def cuda_arch_list() -> str | None:
    return _get("TORCH_CUDA_ARCH_LIST")


def cxx_compiler() -> str:
    return _get("CXX") or "c++"


def debug() -> str | None:
    """None (unset: the op's own flags as they are), "host" (OPB_DEBUG=1: -g, -lineinfo), "device"
    (OPB_DEBUG=device: nvcc -G as well) or "none" (OPB_DEBUG=0: the op's own debug flags dropped too)."""
    raw = _get("OPB_DEBUG")
    if raw is None:
        return None
    if raw.lower() in ("0", "false", "no", "off", "none"):
        return "none"
    if raw.lower() in ("device", "g", "-g"):
        return "device"
    if raw.lower() in ("1", "true", "yes", "on", "host"):
        return "host"
    raise EnvError(f"OPB_DEBUG must be 1 (debug info), 'device' (also nvcc -G) or 0 (none, even where an op's "
                   f"flags ask for it), got {raw!r}")


def nvcc_host_compiler() -> str | None:
    return _get("CC")


def pytorch_nvcc() -> str | None:
    return _get("PYTORCH_NVCC")


def cuda_home_hint() -> str | None:
    return _get("CUDA_HOME") or _get("CUDA_PATH")


def path_dirs() -> list[str]:
    return (os.environ.get("PATH") or "").split(os.pathsep)


def ld_library_path() -> list[str]:
    return [d for d in (os.environ.get("LD_LIBRARY_PATH") or "").split(os.pathsep) if d]


def include_path_variables() -> dict[str, str]:
    """The header search path variables that are set (as set: an empty element means the current folder)."""
    return {name: os.environ[name] for name in INCLUDE_PATH_VARIABLES if os.environ.get(name) is not None}


def trust_shared_cache() -> bool:
    return _flag("OPB_TRUST_SHARED_CACHE")


def fallback() -> bool:
    """Whether a call falls back to the next implementation when one cannot be built or loaded here."""
    return _flag("OPB_FALLBACK", default=True)


def cxx_autograd() -> bool:
    """Whether gradients of the built-in ops take their C++ path (``OPB_CXX_AUTOGRAD``, default on)."""
    return _flag("OPB_CXX_AUTOGRAD", default=True)


#: OPB_COMPILE_INLINE_BELOW's default: 2**21 elements, between the sizes measured (benchmarks/NOTES.md, issue 23):
#: compiled steps of benchmarks/parallel_models.py's models with ops on 2**12-2**20 elements ran faster with the
#: definitions traced (CPU, dim 64 and 256; an H200, dim 256), and at 2**23 and more (dim 1024) the compiled
#: step with our kernels beat PyTorch's.
COMPILE_INLINE_BELOW = 1 << 21


def compile_inline_below() -> int:
    """Elements below which a built-in op's call traced by torch.compile takes the op's PyTorch definition."""
    raw = _get("OPB_COMPILE_INLINE_BELOW")
    if raw is None:
        return COMPILE_INLINE_BELOW
    value = _whole(raw)
    if value is None:
        raise EnvError(f"OPB_COMPILE_INLINE_BELOW must be a whole number of elements >= 0, got {raw!r}")
    return value


def build_all_ops() -> bool:
    return _flag("OPB_BUILD_OPS")


def build_all_ds_ops() -> bool:
    """DeepSpeed's ``DS_BUILD_OPS`` (read by ``opbuilder.deepspeed.prebuild``)."""
    return _flag("DS_BUILD_OPS")


def build_var(name: str) -> bool | None:
    """The value of one op's ``OPB_BUILD_<OP>``: True, False, or None when unset or blank."""
    raw = _get(name)
    if raw is None or not raw.strip():
        return None
    return _flag(name)


def build_var_names() -> list[str]:
    """Every ``OPB_BUILD_<OP>`` that is set, not blank (``OPB_BUILD_OPS`` aside): their names alone, so that a
    misspelt op (or another tool's ``OPB_BUILD_DIR``) is named as such before any value is read."""
    return [name for name in sorted(os.environ)
            if name.startswith("OPB_BUILD_") and name != "OPB_BUILD_OPS" and (_get(name) or "").strip()]


def remote_cache_url() -> str | None:
    return _get("OPB_REMOTE_CACHE")


def remote_cache_secret_file() -> Path | None:
    raw = _get("OPB_REMOTE_CACHE_SECRET_FILE")
    return Path(raw).expanduser() if raw is not None else None


def remote_cache_password_file() -> Path | None:
    raw = _get("OPB_REMOTE_CACHE_PASSWORD_FILE")
    return Path(raw).expanduser() if raw is not None else None


def remote_cache_prefix() -> str | None:
    return _get("OPB_REMOTE_CACHE_PREFIX")


def remote_cache_max_bytes() -> int:
    raw = _get("OPB_REMOTE_CACHE_MAX_BYTES")
    if raw is None:
        return 256 << 20
    value = _whole(raw)
    if value is None or value < 1:
        raise EnvError(f"OPB_REMOTE_CACHE_MAX_BYTES must be a positive number of bytes, got {raw!r}")
    return value


#: The longest remote cache timeout or lease (a day): what a socket timeout and a Redis expiry surely take.
MAX_SECONDS = 86400.0


def _seconds(name: str, default: float) -> float:
    raw = _get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise EnvError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not 0 < value <= MAX_SECONDS:  # nan too; inf or 1e300: no socket timeout or lease expiry takes it
        raise EnvError(f"{name} must be a number of seconds > 0 and at most {MAX_SECONDS:.0f}, got {raw!r}")
    return value


def remote_cache_timeout() -> float:
    return _seconds("OPB_REMOTE_CACHE_TIMEOUT", 5.0)


def remote_lease_seconds() -> float:
    return _seconds("OPB_REMOTE_LEASE_SECONDS", 30.0)


def validate() -> None:
    """Read every variable that has a form to check, raising EnvError at the first one that is wrong: what the
    commands that build, load or judge do first, so that a typo is an error before any build or verdict. The
    ``OPB_BUILD_<OP>`` variables are left to the prebuild, which names those of no op (another tool's
    ``OPB_BUILD_DIR``) before reading any value."""
    for read in (lock_timeout, verbose, max_jobs, debug, trust_shared_cache, fallback, cxx_autograd,
                 compile_inline_below, build_all_ops, build_all_ds_ops, remote_cache_max_bytes, remote_cache_timeout,
                 remote_lease_seconds):
        read()


def subprocess_env(extra: dict[str, str]) -> dict[str, str]:
    """A copy of the environment for a build subprocess; ``os.environ`` itself is left alone."""
    env = dict(os.environ)
    env.update(extra)
    return env
