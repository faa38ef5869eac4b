"""A Triton implementation of an op: where Triton and a GPU are there it is checked and dispatched like any
other; where they are not, check says why and the calls fall back with one warning that names it."""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import replace

import pytest
import torch

from opbuilder import check, definitions, dispatch, implementations as impls
from opbuilder.dispatch import FallbackWarning

HAS_TRITON = importlib.util.find_spec("triton") is not None
OP = "triton_twice_plus_one"


def reference(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def _triton_launcher():
    """y = 2x + 1 as a Triton kernel (defined only where Triton is installed)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2 + 1, mask=mask)

    def launch(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        if x.numel():
            kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y

    return launch


def _plain_launcher(x: torch.Tensor) -> torch.Tensor:  # where Triton is absent: never called
    raise AssertionError("a Triton implementation ran where it cannot load")


def _define(op: str) -> None:
    """y = 2x + 1 on [rows, width], with two workloads."""
    definitions.register(definitions.Definition(
        name=op, axes=("rows", "width"),
        inputs={"x": definitions.TensorSpec(("rows", "width"))},
        outputs={"y": definitions.TensorSpec(("rows", "width"))},
        reference=reference,
        workloads=(definitions.Workload("8x64", (8, 64)), definitions.Workload("7x111", (7, 111))),
    ))


@pytest.fixture
def triton_op():
    _define(OP)
    impls.register(OP, impls.triton("triton", _triton_launcher() if HAS_TRITON else _plain_launcher))
    impls.register(OP, impls.reference(reference))
    yield OP
    dispatch.reset(OP)


@pytest.mark.skipif(HAS_TRITON and torch.cuda.is_available(), reason="Triton and a GPU are here: the test below")
def test_without_triton_or_a_gpu_check_says_why_and_calls_fall_back(triton_op: str) -> None:
    rows = [r for r in check.check(triton_op, names=["triton"]) if r.implementation == "triton"]
    assert rows and {r.status for r in rows} == {"COMPILE_ERROR"}
    assert all(("triton is not installed" in r.message) or ("none is visible" in r.message) for r in rows), rows
    fn = dispatch.apply(triton_op)(reference)
    x = torch.randn(7, 111)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1, y2 = fn(x), fn(x)
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallbacks) == 1 and triton_op in str(fallbacks[0].message), [str(w.message) for w in caught]
    torch.testing.assert_close(y1, reference(x), rtol=0, atol=0)
    torch.testing.assert_close(y2, y1, rtol=0, atol=0)


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs Triton and a GPU")
def test_a_triton_kernel_is_checked_timed_and_dispatched(triton_op: str) -> None:
    rows = check.check(triton_op, device="cuda")
    triton_rows = [r for r in rows if r.implementation == "triton"]
    assert triton_rows and all(r.status == "PASSED" for r in triton_rows), triton_rows
    # A trace in which Triton is the fastest everywhere: dispatch sends the GPU calls to it.
    check.save(triton_op, [replace(r, us=1.0 if r.implementation == "triton" else 9.0) for r in rows], "tune")
    dispatch.reset(triton_op)
    fn = dispatch.apply(triton_op)(reference)
    x = torch.randn(7, 111, device="cuda")
    assert fn.pick(x) == "triton"
    torch.testing.assert_close(fn(x), reference(x.double()).float(), rtol=1e-6, atol=1e-6)


def test_the_gpu_tests_sequence_on_the_cpu_with_a_python_stand_in() -> None:
    """What the GPU test above does, with a Python implementation in the Triton kernel's place: check, a
    trace in which it is fastest, ``dispatch.reset`` before the op's first ``apply`` (nothing to forget
    yet, not an error), then dispatch sends the calls to it."""
    op = "stand_in_twice_plus_one"
    _define(op)
    impls.register(op, impls.python("stand_in", lambda x: x * 2 + 1))
    impls.register(op, impls.reference(reference))
    try:
        rows = check.check(op, device="cpu")
        assert rows and all(r.status == "PASSED" for r in rows if r.implementation == "stand_in"), rows
        check.save(op, [replace(r, us=1.0 if r.implementation == "stand_in" else 9.0) for r in rows], "tune")
        dispatch.reset(op)
        fn = dispatch.apply(op)(reference)
        x = torch.randn(7, 111)
        assert fn.pick(x) == "stand_in"
        torch.testing.assert_close(fn(x), reference(x.double()).float(), rtol=1e-6, atol=1e-6)
    finally:
        dispatch.reset(op)


def test_reset_of_a_name_nothing_registered_names_the_known_ops() -> None:
    from opbuilder.errors import UnknownOpError

    with pytest.raises(UnknownOpError, match="no dispatched op named 'never_registered_op'; known: relu"):
        dispatch.reset("never_registered_op")
