"""opbuilder.torchop.fakes: a fake registered without torch's source lookup serves FakeTensor, meta tensors and
opcheck as ``torch.library.register_fake`` does, names its own line, and falls back to the public call where
torch's registry is laid out otherwise."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from opbuilder.torchop import fakes

_COUNT = itertools.count()


def _op() -> str:
    """A new op ``twice(Tensor x) -> Tensor`` (CPU kernel: 2x) in a namespace of its own; its qualname."""
    ns = f"opb_test_fakes_{next(_COUNT)}"
    lib = torch.library.Library(ns, "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CPU")
    _op.libs.append(lib)  # kept alive for the test's life
    return f"{ns}::twice"


_op.libs = []  # type: ignore[attr-defined]


def _register(qualname: str) -> None:
    @fakes.register_fake(qualname)
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)


def _check(qualname: str) -> None:
    op = getattr(getattr(torch.ops, qualname.split("::")[0]), "twice").default
    with FakeTensorMode():
        y = op(torch.empty(3, 4))
    assert y.shape == (3, 4)
    assert op(torch.empty(5, device="meta")).device.type == "meta"
    torch.library.opcheck(op, (torch.randn(4, 3),))


def test_a_fake_serves_fake_tensors_meta_and_opcheck_and_names_its_line() -> None:
    qualname = _op()
    _register(qualname)
    _check(qualname)
    source = torch._library.simple_registry.singleton.find(qualname).fake_impl.kernel.source
    assert source == f"{__file__}:{_register.__code__.co_firstlineno + 1}"


def test_another_layout_of_torchs_registry_takes_the_public_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._library.fake_impl import FakeImplHolder

    qualname = _op()
    calls = []
    public = torch.library.register_fake

    def older_register(self, func, source):  # a holder whose register takes no Library
        raise AssertionError("called with this torch's arguments")

    def spy(*args, **kwargs):
        calls.append(args[0])
        monkeypatch.undo()  # torch's own layout back for the public call
        return public(*args, **kwargs)

    monkeypatch.setattr(FakeImplHolder, "register", older_register)
    monkeypatch.setattr(torch.library, "register_fake", spy)
    _register(qualname)
    assert calls == [qualname]
    _check(qualname)
