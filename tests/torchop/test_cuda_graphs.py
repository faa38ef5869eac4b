"""Whole training steps with our layers under CUDA graphs, as host-bound training takes them: the step captured by
hand (``torch.cuda.graph``: forward, loss and the backward through the ops' C++ Nodes), a model's forward and
backward captured apart (``torch.cuda.make_graphed_callables``) and ``torch.compile(mode="reduce-overhead")``
(Inductor's CUDA graph trees, our kernels as extern calls and traced as their definitions). A replay must compute
what eager computes on the replay's inputs."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, requires_cuda

sys.path.insert(0, str(ROOT / "benchmarks"))
from parallel_models import FFNModel, Model, twins  # noqa: E402  (benchmarks/ is no package)

pytestmark = requires_cuda

# FFNModel's FusedLinearReLU takes relu_bias_backward (rows of 256 bytes and more) in its backward.
DIM, HIDDEN, TOKENS = 64, 256, 192
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _loss(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), target)


def _eager_grads(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    loss = _loss(model, x, target)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(TOKENS, DIM, generator=g).cuda()
    return x, torch.randn(TOKENS, DIM, generator=g).cuda()


def _node_names(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> set[str]:
    """The names of the autograd Nodes of one step's graph."""
    seen, todo, names = set(), [_loss(model, x, target).grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("cls", [FFNModel, Model], ids=lambda c: c.__name__)
def test_a_step_captured_whole_replays_as_eager(cls: type[torch.nn.Module], cxx_autograd_glue: Path) -> None:
    ours, _ = twins(cls, DIM, HIDDEN, torch.float32, "cuda")
    eager = copy.deepcopy(ours)
    static_x, static_target = _inputs(0)
    # The step's backward runs through the ops' C++ Nodes (the path a training step takes once the glue is there).
    assert any(name.startswith("opbuilder::") for name in _node_names(ours, static_x, static_target))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: first calls, routes, cuBLASLt plans
        for _ in range(3):
            ours.zero_grad(set_to_none=True)
            _loss(ours, static_x, static_target).backward()
    torch.cuda.current_stream().wait_stream(side)
    ours.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _loss(ours, static_x, static_target)
        static_loss.backward()
    grads = [p.grad for p in ours.parameters()]

    first = None
    for seed in (1, 2):  # two new batches: each replay computes its own
        x, target = _inputs(seed)
        static_x.copy_(x)
        static_target.copy_(target)
        graph.replay()
        torch.cuda.synchronize()
        want_loss, want_grads = _eager_grads(eager, x, target)
        torch.testing.assert_close(static_loss, want_loss, **TOL)
        for got, want in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, want, **TOL)
        if first is None:
            first = [g.clone() for g in grads]
    assert not all(torch.equal(a, b) for a, b in zip(first, grads)), "the replays computed the same gradients"


@pytest.mark.parametrize("cls", [FFNModel, Model], ids=lambda c: c.__name__)
def test_make_graphed_callables_trains_as_eager(cls: type[torch.nn.Module], cxx_autograd_glue: Path) -> None:
    ours, _ = twins(cls, DIM, HIDDEN, torch.float32, "cuda")
    eager = copy.deepcopy(ours)
    sample = _inputs(0)[0].requires_grad_()  # a gradient for the input too: the layer below would want it
    graphed = torch.cuda.make_graphed_callables(ours, (sample,))
    for seed in (1, 2):
        x, target = _inputs(seed)
        x_ours, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours.zero_grad(set_to_none=True)
        loss = _loss(graphed, x_ours, target)
        loss.backward()
        eager.zero_grad(set_to_none=True)
        want_loss = _loss(eager, x_eager, target)
        want_loss.backward()
        torch.testing.assert_close(loss, want_loss, **TOL)
        torch.testing.assert_close(x_ours.grad, x_eager.grad, **TOL)
        for p, q in zip(ours.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **TOL)


@pytest.mark.parametrize("inline_below", [None, "0"], ids=["default", "our-kernels-at-every-size"])
@pytest.mark.parametrize("cls", [FFNModel, Model], ids=lambda c: c.__name__)
def test_reduce_overhead_compile_trains_as_eager(cls: type[torch.nn.Module], inline_below: str | None,
                                                cxx_autograd_glue: Path) -> None:
    torch._dynamo.reset()
    ours, _ = twins(cls, DIM, HIDDEN, torch.float32, "cuda")
    eager = copy.deepcopy(ours)
    compiled = torch.compile(ours, mode="reduce-overhead", fullgraph=True)
    env = {} if inline_below is None else {"OPB_COMPILE_INLINE_BELOW": inline_below}
    with mock.patch.dict(os.environ, env), mock.patch.object(torch._inductor.config.triton, "cudagraph_or_error", True):
        for seed in range(4):  # warm-up, recording, then replays
            torch.compiler.cudagraph_mark_step_begin()
            x, target = _inputs(seed)
            ours.zero_grad(set_to_none=True)
            loss = _loss(compiled, x, target)
            loss.backward()
            want_loss, want_grads = _eager_grads(eager, x, target)
            torch.testing.assert_close(loss, want_loss, **TOL)
            for p, want in zip(ours.parameters(), want_grads, strict=True):
                torch.testing.assert_close(p.grad, want, **TOL)
