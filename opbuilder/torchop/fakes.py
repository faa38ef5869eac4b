"""Registering an op's fake (``torch.library.register_fake``) at its load, cheaply.

``torch.library.register_fake`` names where a fake came from by asking ``inspect`` for the caller's frame
(``getframeinfo``, which reads the file and walks every loaded module to find its name) and makes a new
``Library`` each time: about half a millisecond a fake, most of the registration cost of a built-in op's
first call (relu registers five). Here the source is the function's own file and first line, and each
namespace has one ``Library``; the fake lands in the same holder (``torch._library``'s registry, and a
``Meta`` kernel that runs it), so FakeTensor, meta tensors, ``torch.compile`` and ``opcheck`` see what the
public call gives. Where torch's registry is laid out otherwise, the public call does it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable[..., object])

# namespace -> the Library the namespace's fakes are registered through (kept: dropping it would unregister them)
_LIBRARIES: dict[str, torch.library.Library] = {}


def _library(namespace: str) -> torch.library.Library:
    lib = _LIBRARIES.get(namespace)
    if lib is None:
        lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return lib


def register_fake(qualname: str) -> Callable[[F], F]:
    """A decorator: ``fn`` becomes the fake of the op ``qualname`` ("ns::op" or "ns::op.overload"), as with
    ``torch.library.register_fake(qualname)``."""

    def decorate(fn: F) -> F:
        lib = _library(qualname.partition("::")[0])
        try:
            holder = torch._library.simple_registry.singleton.find(qualname).fake_impl
            register = holder.register
            fits = "lib" in register.__code__.co_varnames
        except AttributeError:
            fits = False
        if not fits:  # another torch's layout of its registry
            torch.library.register_fake(qualname, fn, lib=lib)
            return fn
        code = fn.__code__
        register(fn, f"{code.co_filename}:{code.co_firstlineno}", lib=lib)
        return fn

    return decorate
