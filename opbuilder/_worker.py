"""Runs one build in its own process group: ``python -m opbuilder._worker SPEC.json``.

The parent starts it with a new session, so ending the group ends ninja and every compiler.
If the parent dies (even by SIGKILL), the kernel sends this process SIGTERM and it ends its group.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def _end_group(signum: int, _frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def main(spec_path: str) -> int:
    signal.signal(signal.SIGTERM, _end_group)
    signal.signal(signal.SIGINT, _end_group)
    _die_with_parent()
    with open(spec_path) as fh:
        spec = json.load(fh)
    if os.getppid() != spec["parent_pid"]:  # the parent died before prctl took effect
        _end_group(signal.SIGTERM, None)
    from torch.utils.cpp_extension import load

    load(
        name=spec["name"],
        sources=spec["sources"],
        extra_cflags=spec["cxx_args"],
        extra_cuda_cflags=spec["nvcc_args"],
        extra_ldflags=spec["ldflags"],
        extra_include_paths=spec["include_paths"],
        build_directory=spec["build_dir"],
        verbose=True,
        with_cuda=spec["with_cuda"],
        is_python_module=spec["python_module"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
