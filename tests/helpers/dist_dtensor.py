"""DTensor checks on every rank (run by tests/torchop/test_dtensor.py through torch.distributed.run, gloo, CPU).

1. Each op on DTensor inputs (Shard(d) for each d, Replicate, a 2-D mesh on 4 ranks), forward and
   backward, equal to the same function on the full tensors; the backward ops called on Partial
   gradients, equal to the op on their sum.
2. A two-block model from opbuilder's layers under sequence parallelism (norms on sequence-sharded
   activations), under FSDP2 (``fully_shard``) and, on 4 ranks, under both (a 2 x 2 mesh), one step
   each: the loss and the gradients equal those of the same model built from PyTorch layers under the
   same plan, and those of the plain model on one process.

Every rank writes ``rank<N>.json`` with the number of checks and the failures (a check that raised
is a failure too); the test reads them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import opbuilder.ops as ops
from opbuilder.ops.fused_add_rmsnorm import fused_add_rmsnorm_backward_op
from opbuilder.ops.fused_matmul_add_relu import fused_matmul_add_relu_op, relu_bias_backward_op
from opbuilder.ops.fused_relu_layernorm import fused_relu_layernorm_backward_op, fused_relu_layernorm_op
from opbuilder.ops.relu import relu_mask_backward_op, relu_mask_op
from opbuilder.ops.softmax import backward_op as softmax_backward_op
from opbuilder.torchop import cxx_autograd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import parallel_models  # noqa: E402  (benchmarks/ is no package)
from parallel_models import FFNModel, Model, exit_rank, sequence_parallel  # noqa: E402

DTYPE = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-11}


class Checks:
    def __init__(self) -> None:
        self.count, self.failures = 0, []

    def run(self, name: str, fn: Callable[[], None]) -> None:
        self.count += 1
        try:
            fn()
        except Exception:
            self.failures.append(f"{name}: {traceback.format_exc(limit=6)}")


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:  # a DTensor's global shape, which its local pieces need not show
        raise AssertionError(f"{what}: shape {list(got.shape)}, expected {list(want.shape)}")
    got = full(got)
    if got.shape != want.shape or not torch.allclose(got, want, **TOL):
        diff = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        raise AssertionError(f"{what}: differs from the full-tensor result (max diff {diff}, shapes "
                             f"{list(got.shape)} vs {list(want.shape)})")


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def same_as_full(mesh, fn, tensors, placements, grad: bool = True) -> None:
    """fn on DTensors (``placements[i]`` a list per mesh dim, or None for a plain None input) equals fn on
    the full tensors, forward and (if ``grad``) backward for every float input."""
    ref_in = [None if t is None else t.clone().requires_grad_(grad) for t in tensors]
    ref_out = as_tuple(fn(*ref_in))
    dt_in = [None if t is None else distribute_tensor(t, mesh, p).requires_grad_(grad)
             for t, p in zip(tensors, placements)]
    dt_out = as_tuple(fn(*dt_in))
    for i, (a, b) in enumerate(zip(dt_out, ref_out)):
        close(f"output {i}", a, b)
    if not grad:
        return
    outs = [(a, b) for a, b in zip(dt_out, ref_out) if b.requires_grad]
    grads = [torch.randn_like(b) for _, b in outs]
    leaves = [(d, r) for d, r in zip(dt_in, ref_in) if r is not None]
    ref_g = torch.autograd.grad([b for _, b in outs], [r for _, r in leaves], grads, allow_unused=True)
    dt_grads = [distribute_tensor(g, mesh, a.placements) for (a, _), g in zip(outs, grads)]
    got_g = torch.autograd.grad([a for a, _ in outs], [d for d, _ in leaves], dt_grads, allow_unused=True)
    for i, (a, b) in enumerate(zip(got_g, ref_g)):
        if b is None:
            continue
        close(f"grad of input {i}", a, b)


def partial_of(mesh, t: torch.Tensor) -> DTensor:
    """A Partial DTensor whose ranks' pieces sum to ``t`` (random pieces, the same on every rank)."""
    n = mesh.size()
    pieces = [torch.randn_like(t) for _ in range(n - 1)]
    pieces.append(t - sum(pieces))
    return DTensor.from_local(pieces[mesh.get_local_rank()], mesh, [Partial()], run_check=False)


def op_checks(checks: Checks, mesh, tag: str) -> None:
    S, R = Shard, Replicate()
    x = torch.randn(7, 6, 5, dtype=DTYPE)
    r = torch.randn(7, 6, 5, dtype=DTYPE)
    w = torch.randn(5, dtype=DTYPE)
    b = torch.randn(5, dtype=DTYPE)
    for p in (S(0), S(1), S(2), R):
        checks.run(f"{tag} relu {p}", lambda: same_as_full(mesh, ops.relu, [x], [[p]]))
        checks.run(f"{tag} relu no grad {p}", lambda: same_as_full(mesh, ops.relu, [x], [[p]], grad=False))
        # ops.relu takes relu's plain backward for DTensors; the mask op called itself has its rule too.
        checks.run(f"{tag} relu_mask op {p}", lambda: same_as_full(mesh, lambda t: relu_mask_op()(t)[0], [x], [[p]]))
        checks.run(f"{tag} softmax {p}", lambda: same_as_full(mesh, ops.softmax, [x], [[p]]))
        checks.run(f"{tag} softmax dim=1 {p}", lambda: same_as_full(mesh, lambda t: ops.softmax(t, 1), [x], [[p]]))
        checks.run(f"{tag} rms_norm {p}", lambda: same_as_full(mesh, ops.rms_norm, [x, w], [[p], [R]]))
        checks.run(f"{tag} fused_add_rmsnorm {p}",
                   lambda: same_as_full(mesh, ops.fused_add_rmsnorm, [x, r, w], [[p], [p], [R]]))
        checks.run(f"{tag} fused_relu_layernorm {p}",
                   lambda: same_as_full(mesh, ops.fused_relu_layernorm, [x, w, b], [[p], [R], [R]]))
    # Mixed layouts: redistributed to one the rule accepts.
    checks.run(f"{tag} fused_add_rmsnorm S0+S1, weight S0",
               lambda: same_as_full(mesh, ops.fused_add_rmsnorm, [x, r, w], [[S(0)], [S(1)], [S(0)]]))
    checks.run(f"{tag} fused_relu_layernorm no affine S1",
               lambda: same_as_full(mesh, ops.fused_relu_layernorm, [x], [[S(1)]]))

    mm = ops.fused_matmul_add_relu
    lhs, rhs = torch.randn(7, 5, dtype=DTYPE), torch.randn(5, 6, dtype=DTYPE)
    bias_n, bias_mn = torch.randn(6, dtype=DTYPE), torch.randn(7, 6, dtype=DTYPE)
    for pl, pr, pb in ((S(0), R, R), (R, S(1), S(0)), (R, R, R), (S(1), S(0), R)):
        checks.run(f"{tag} matmul {pl} {pr} bias {pb}",
                   lambda: same_as_full(mesh, mm, [lhs, rhs, bias_n], [[pl], [pr], [pb]]))
    checks.run(f"{tag} matmul bias [M, N] S0",
               lambda: same_as_full(mesh, mm, [lhs, rhs, bias_mn], [[S(0)], [R], [S(0)]]))
    checks.run(f"{tag} matmul no bias S0",
               lambda: same_as_full(mesh, mm, [lhs, rhs, None], [[S(0)], [R], None]))
    blhs, brhs, bbias = torch.randn(5, 3, 4, dtype=DTYPE), torch.randn(5, 4, 6, dtype=DTYPE), torch.randn(3, 6, dtype=DTYPE)
    for pl, pr in ((S(0), S(0)), (S(1), R), (R, S(2)), (S(2), S(1))):
        checks.run(f"{tag} bmm {pl} {pr}", lambda: same_as_full(mesh, mm, [blhs, brhs, bbias], [[pl], [pr], [R]]))
    # A batch that splits evenly: the backward flattens lhs's batch into rows, which DTensor does only for
    # an even split.
    checks.run(f"{tag} bmm rhs 2-D, lhs S0",
               lambda: same_as_full(mesh, mm, [blhs[:4], brhs[0], bbias], [[S(0)], [R], [R]]))

    # The backward ops are linear in the incoming gradients: Partial in, Partial out.
    def partial_backwards() -> None:
        g, g2 = torch.randn_like(x), torch.randn_like(x)
        eps = 1e-6
        R1 = [R]

        def dt(t):
            return distribute_tensor(t, mesh, R1)

        want = fused_add_rmsnorm_backward_op()(g, None, x, w, eps)
        got = fused_add_rmsnorm_backward_op()(partial_of(mesh, g), None, dt(x), dt(w), eps)
        for i, (a, c) in enumerate(zip(got, want)):
            assert a.placements == (Partial(),), a.placements
            close(f"rms backward output {i}", a, c)
        want = fused_add_rmsnorm_backward_op()(g, g2, x, w, eps)
        got = fused_add_rmsnorm_backward_op()(partial_of(mesh, g), partial_of(mesh, g2), dt(x), dt(w), eps)
        for i, (a, c) in enumerate(zip(got, want)):
            close(f"fused_add_rmsnorm backward output {i}", a, c)
        y = torch.softmax(x, -1)
        close("softmax backward", softmax_backward_op()(dt(y), partial_of(mesh, g)), softmax_backward_op()(y, g))
        _, mean, rstd = fused_relu_layernorm_op()(x, w, b, 1e-5)
        want = fused_relu_layernorm_backward_op()(g, x, w, mean, rstd, True)
        got = fused_relu_layernorm_backward_op()(partial_of(mesh, g), dt(x), dt(w), dt(mean), dt(rstd), True)
        for i, (a, c) in enumerate(zip(got, want)):
            close(f"layernorm backward output {i}", a, c)
        _, mask = relu_mask_op()(x)
        close("relu mask backward", relu_mask_backward_op()(partial_of(mesh, g), dt(mask)),
              relu_mask_backward_op()(g, mask))
        g2, y2 = torch.randn(7, 6, dtype=DTYPE), torch.randn(7, 6, dtype=DTYPE)
        want = relu_bias_backward_op()(g2, y2)
        got = relu_bias_backward_op()(partial_of(mesh, g2), dt(y2))
        for i, (a, c) in enumerate(zip(got, want)):
            assert a.placements == (Partial(),), a.placements
            close(f"relu_bias_backward output {i}", a, c)
        got = relu_bias_backward_op()(distribute_tensor(g2, mesh, [S(0)]), distribute_tensor(y2, mesh, [S(0)]))
        assert got[1].placements == (Partial(),), got[1].placements
        for i, (a, c) in enumerate(zip(got, want)):
            close(f"relu_bias_backward rows split, output {i}", a, c)
        # Columns split (a column-parallel layer's output): each rank sums its own columns, the bias's
        # gradient comes split like them, and nothing is gathered.
        g3, y3 = (torch.randn(7, 4 * mesh.size(), dtype=DTYPE) for _ in range(2))
        want = relu_bias_backward_op()(g3, y3)
        got = relu_bias_backward_op()(distribute_tensor(g3, mesh, [S(1)]), distribute_tensor(y3, mesh, [S(1)]))
        assert (got[0].placements, got[1].placements) == ((S(1),), (S(0),)), (got[0].placements, got[1].placements)
        for i, (a, c) in enumerate(zip(got, want)):
            close(f"relu_bias_backward columns split, output {i}", a, c)

    # affine_grads (a bool) changes the shapes of grad_weight and grad_bias: DTensor must not reuse the
    # shapes it cached for the other value.
    def layernorm_backward_both_ways() -> None:
        g = torch.randn_like(x)
        _, mean, rstd = fused_relu_layernorm_op()(x, w, b, 1e-5)
        for affine in (True, False, True):
            want = fused_relu_layernorm_backward_op()(g, x, w, mean, rstd, affine)
            got = fused_relu_layernorm_backward_op()(
                *[distribute_tensor(t, mesh, [S(0)]) for t in (g, x)], distribute_tensor(w, mesh, [R]),
                *[distribute_tensor(t, mesh, [S(0)]) for t in (mean, rstd)], affine)
            for i, (a, c) in enumerate(zip(got, want)):
                close(f"affine_grads={affine} output {i}", a, c)

    # Where the row ops' outputs lie, as aten's norms and softmax: a split rows keep, rows split along
    # themselves gathered (Replicate) -- never a split moved to another dim by an all-to-all, which the
    # next tensor-parallel linear would move back (a Shard(2) softmax input became Shard(0) before).
    def row_layouts() -> None:
        # Even splits of a size where DTensor's cost model prices an all-to-all below an all-gather.
        xs, rs, ws = torch.randn(8, 64, 64, dtype=DTYPE), torch.randn(8, 64, 64, dtype=DTYPE), torch.randn(64, dtype=DTYPE)
        for fn, extra in ((ops.softmax, []), (ops.rms_norm, [ws]), (ops.relu, [])):
            for given, want in ((S(2), R), (S(1), S(1)), (S(0), S(0)), (R, R)):
                got = fn(distribute_tensor(xs.clone().requires_grad_(), mesh, [given]),
                         *[distribute_tensor(t, mesh, [R]) for t in extra])
                want_here = given if fn is ops.relu else want  # relu is elementwise: any split stays
                assert got.placements == (want_here,), (fn.__name__, given, got.placements)
        out, h = ops.fused_add_rmsnorm(*[distribute_tensor(t, mesh, [S(2)]) for t in (xs, rs)],
                                       distribute_tensor(ws, mesh, [R]))
        assert out.placements == h.placements == (R,), (out.placements, h.placements)

    # relu_mask's mask holds each rank's own piece's bits, padded per piece: chunking a whole mask for a split
    # grad_y, or gathering a split mask for a Partial one, gave wrong gradients (sizes that happen to match).
    def mask_never_redistributed() -> None:
        xm, gm = torch.randn(3, 50), torch.randn(3, 50)  # float32: a piece of 100 elements pads to 128 bits
        want = relu_mask_backward_op()(gm, relu_mask_op()(xm)[1])
        for px, grad in ((R, distribute_tensor(gm, mesh, [S(0)])), (S(0), partial_of(mesh, gm))):
            _, mask = relu_mask_op()(distribute_tensor(xm, mesh, [px]))
            got = relu_mask_backward_op()(grad, mask).full_tensor()  # float32: the Partial pieces' sum rounds
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), \
                f"relu_mask_backward, x {px}, grad_y {grad.placements}: max diff {(got - want).abs().max().item()}"

    # The matmul op's shapes are checked whole, not only each rank's piece: a bias or a batch that does not fit
    # the whole output fitted every piece here (a result where the whole tensors are refused).
    def matmul_op_checks_whole_shapes() -> None:
        n = mesh.size()
        lhs2, rhs2, bias2 = torch.randn(3, 4, dtype=DTYPE), torch.randn(4, 2 * n, dtype=DTYPE), torch.randn(n, dtype=DTYPE)
        lhs3, rhs3 = torch.randn(2 * n, 3, 4, dtype=DTYPE), torch.randn(n, 4, 5, dtype=DTYPE)
        cases = [([lhs2, rhs2, bias2], [R, S(1), R], "bias must broadcast to the output's shape"),
                 ([lhs3, rhs3, None], [S(0), S(0), None], "the batch dims of lhs and rhs must be equal or 1")]
        for tensors, placements, message in cases:
            args = [None if t is None else distribute_tensor(t, mesh, [p]) for t, p in zip(tensors, placements)]
            try:
                fused_matmul_add_relu_op()(*args)
            except (RuntimeError, ValueError) as exc:
                assert f"fused_matmul_add_relu: {message}" in str(exc), str(exc)
            else:
                raise AssertionError(f"no error for {[None if t is None else list(t.shape) for t in tensors]}")

    # An empty lhs split on its rows, on either gradient path (the Python one reshaped it, which DTensor refused).
    def matmul_empty_rows() -> None:
        tensors = [torch.randn(0, 4, dtype=DTYPE), torch.randn(4, 6, dtype=DTYPE), torch.randn(6, dtype=DTYPE)]
        for path in (contextlib.nullcontext(), cxx_autograd.disabled()):
            with path:
                same_as_full(mesh, ops.fused_matmul_add_relu, tensors, [[S(0)], [R], [R]])

    # lhs and rhs with a batch of one, split across ranks (one rank holds it, the others none): rhs's gradient
    # is a batched GEMM, as torch.matmul's (flattening the batch was a view DTensor refused), on either path.
    def matmul_batch_of_one_split() -> None:
        lhs, rhs, bias = torch.randn(1, 5, 4, dtype=DTYPE), torch.randn(1, 4, 3, dtype=DTYPE), torch.randn(3, dtype=DTYPE)
        for path in (contextlib.nullcontext(), cxx_autograd.disabled()):
            with path:
                for placements in ([[S(0)], [S(0)], [R]], [[S(0)], [R], [R]]):
                    same_as_full(mesh, ops.fused_matmul_add_relu, [lhs, rhs, bias], placements)

    if mesh.ndim == 1:
        checks.run(f"{tag} backward ops on Partial gradients", partial_backwards)
        checks.run(f"{tag} matmul: a batch of one split across ranks", matmul_batch_of_one_split)
        checks.run(f"{tag} matmul op: shapes checked whole", matmul_op_checks_whole_shapes)
        checks.run(f"{tag} matmul: an empty lhs split on its rows", matmul_empty_rows)
        checks.run(f"{tag} relu_mask: its mask is never redistributed", mask_never_redistributed)
        checks.run(f"{tag} layernorm backward, affine_grads True/False", layernorm_backward_both_ways)
        checks.run(f"{tag} row ops keep a split or gather the rows, never move a split", row_layouts)


def mesh2d_checks(checks: Checks, mesh) -> None:
    S, R = Shard, Replicate()
    x, r, w = torch.randn(7, 6, 5, dtype=DTYPE), torch.randn(7, 6, 5, dtype=DTYPE), torch.randn(5, dtype=DTYPE)
    for p in ([S(0), S(1)], [S(1), S(0)], [R, S(0)], [S(0), S(0)]):
        checks.run(f"2-D relu {p}", lambda: same_as_full(mesh, ops.relu, [x], [p]))
        checks.run(f"2-D fused_add_rmsnorm {p}",
                   lambda: same_as_full(mesh, ops.fused_add_rmsnorm, [x, r, w], [p, p, [R, R]]))
        checks.run(f"2-D softmax {p}", lambda: same_as_full(mesh, ops.softmax, [x], [p]))
    lhs, rhs, bias = torch.randn(7, 5, dtype=DTYPE), torch.randn(5, 6, dtype=DTYPE), torch.randn(6, dtype=DTYPE)
    checks.run("2-D matmul", lambda: same_as_full(mesh, ops.fused_matmul_add_relu, [lhs, rhs, bias],
                                                  [[S(0), R], [R, S(1)], [R, S(0)]]))


# ---- models (benchmarks/parallel_models.py) ----------------------------------------------------------------


def twins(cls, dim: int, hidden: int):
    """(opbuilder model, PyTorch model, PyTorch model to run on this process alone), the same weights."""
    fused, plain = parallel_models.twins(cls, dim, hidden, DTYPE)
    reference = cls(dim, hidden, False).to(DTYPE)
    reference.load_state_dict(plain.state_dict())
    return fused, plain, reference


def grads_match(fused: nn.Module, plain: nn.Module, reference: nn.Module, scale: float = 1.0) -> None:
    for (name, a), (_, b), (_, c) in zip(fused.named_parameters(), plain.named_parameters(),
                                         reference.named_parameters()):
        close(f"grad of {name} (opbuilder vs PyTorch, same plan)", full(a.grad), full(b.grad))
        close(f"grad of {name} (opbuilder vs one process)", full(a.grad), c.grad * scale)


def sp_step(mesh) -> None:
    fused, plain, reference = twins(Model, dim=8, hidden=16)
    x, target = torch.randn(2, 8, 8, dtype=DTYPE), torch.randn(2, 8, 8, dtype=DTYPE)
    losses = []
    for model in (sequence_parallel(fused, mesh), sequence_parallel(plain, mesh), reference):
        inp = distribute_tensor(x, mesh, [Shard(1)]) if model is not reference else x
        loss = F.mse_loss(model(inp), target)
        loss.backward()
        losses.append(loss.detach())
    close("loss (opbuilder vs PyTorch, same plan)", losses[0], losses[1])
    close("loss (opbuilder vs one process)", losses[0], losses[2])
    grads_match(fused, plain, reference)


def fsdp_step(mesh) -> None:
    fused, plain, reference = twins(FFNModel, dim=8, hidden=16)
    n, rank = mesh.size(), mesh.get_local_rank()
    gen = torch.Generator().manual_seed(7)
    data = [(torch.randn(2, 5, 8, generator=gen, dtype=DTYPE), torch.randn(2, 5, 8, generator=gen, dtype=DTYPE))
            for _ in range(n)]
    losses = []
    for model in (fused, plain):
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss = F.mse_loss(model(data[rank][0]), data[rank][1])
        loss.backward()
        losses.append(loss.detach())
    close("FSDP2 loss (opbuilder vs PyTorch)", losses[0], losses[1])
    # FSDP2 averages the ranks' gradients: the reference is the mean loss over every rank's batch.
    sum(F.mse_loss(reference(x), y) for x, y in data).div(n).backward()
    grads_match(fused, plain, reference)


def fsdp_sp_step() -> None:
    """FSDP2 over dp = 2 and sequence parallelism over tp = 2 (4 ranks): each dp group its own batch."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    fused, plain, reference = twins(Model, dim=8, hidden=16)
    gen = torch.Generator().manual_seed(11)
    data = [(torch.randn(2, 8, 8, generator=gen, dtype=DTYPE), torch.randn(2, 8, 8, generator=gen, dtype=DTYPE))
            for _ in range(2)]
    x, target = data[mesh["dp"].get_local_rank()]
    losses = []
    for model in (fused, plain):
        sequence_parallel(model, mesh["tp"])
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        loss = F.mse_loss(model(distribute_tensor(x, mesh["tp"], [Shard(1)])), target)
        loss.backward()
        losses.append(loss.detach())
    close("FSDP2 x SP loss (opbuilder vs PyTorch)", losses[0], losses[1])
    sum(F.mse_loss(reference(a), b) for a, b in data).div(2).backward()
    grads_match(fused, plain, reference)


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same full tensors on every rank
    mesh = init_device_mesh("cpu", (world,))
    checks = Checks()
    op_checks(checks, mesh, f"1-D mesh of {world}")
    if world == 4:
        mesh2d_checks(checks, init_device_mesh("cpu", (2, 2)))
    checks.run("sequence parallel step", lambda: sp_step(mesh))
    checks.run("FSDP2 step", lambda: fsdp_step(mesh))
    if world == 4:
        checks.run("FSDP2 x sequence parallel step (2-D mesh)", fsdp_sp_step)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "checks": checks.count, "failures": checks.failures}, fh)
    dist.barrier()
    dist.destroy_process_group()
    exit_rank(0)


if __name__ == "__main__":
    main(sys.argv[1])
