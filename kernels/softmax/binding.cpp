// softmax as Torch ops on the LibTorch stable ABI: schemas, input checks, CPU and CUDA implementations.
//
//   forward(x) -> y                     softmax over x's last dim
//   forward.nograd(x) -> y              the same with no autograd formula: what a call that records no
//                                       gradient takes (ops/softmax.py registers none for it)
//   backward(y, grad_y) -> grad_x       grad_x = y * (grad_y - sum(grad_y * y, -1))
// CUDA only, for tests and tuning (a plan is [path, threads, vpt, cluster]; softmax.cuh explains it):
//   default_plan(x, backward) -> int[]  the plan forward/backward would use for a tensor like x
//   forward_with_plan(x, plan) -> y
//   backward_with_plan(y, grad_y, plan) -> grad_x
#include <opbuilder/stable.h>

#include "softmax_cpu.h"
#ifdef OPB_WITH_CUDA
#include "softmax.cuh"
#endif

#include <initializer_list>
#include <optional>
#include <utility>
#include <vector>

namespace {

using opb::Tensor;

constexpr const char* kForward = "softmax.forward";
constexpr const char* kBackward = "softmax.backward";

// rows x cols view of a contiguous tensor whose last dim is cols.
struct Rows {
  int64_t rows;
  int64_t cols;
};

Rows rows_of(const Tensor& t, const char* op, const char* arg) {
  STD_TORCH_CHECK(t.dim() >= 1, op, ": ", arg, " must have at least 1 dim (the softmax dim), got a 0-d tensor");
  const int64_t cols = t.size(-1);
  return {cols == 0 ? 0 : t.numel() / cols, cols};
}

Tensor prepare_forward(const Tensor& x) {
  opb::dtype_of(x, kForward, "x");
  rows_of(x, kForward, "x");
  return opb::contiguous(x);
}

std::pair<Tensor, Tensor> prepare_backward(const Tensor& y, const Tensor& grad_y) {
  opb::dtype_of(y, kBackward, "y");
  rows_of(y, kBackward, "y");
  STD_TORCH_CHECK(grad_y.scalar_type() == y.scalar_type(), kBackward, ": grad_y must have y's dtype ",
                  y.scalar_type(), ", got ", grad_y.scalar_type());
  STD_TORCH_CHECK(opb::same_device(grad_y, y), kBackward, ": grad_y must be on y's device ", opb::device_str(y),
                  ", got ", opb::device_str(grad_y));
  STD_TORCH_CHECK(opb::same_shape(grad_y, y), kBackward, ": grad_y must have y's shape ", opb::shape_str(y.sizes()),
                  ", got ", opb::shape_str(grad_y.sizes()));
  return {opb::contiguous(y), opb::contiguous(grad_y)};
}

Tensor forward_cpu(Tensor x) {
  Tensor xc = prepare_forward(x);
  Tensor y = opb::new_output(xc);
  const Rows r = rows_of(xc, kForward, "x");
  opb::softmax::forward_cpu(xc.const_data_ptr(), y.mutable_data_ptr(), r.rows, r.cols,
                            opb::dtype_of(xc, kForward, "x"));
  return y;
}

Tensor backward_cpu(Tensor y, Tensor grad_y) {
  auto [yc, gc] = prepare_backward(y, grad_y);
  Tensor grad_x = opb::new_output(yc);
  const Rows r = rows_of(yc, kBackward, "y");
  opb::softmax::backward_cpu(yc.const_data_ptr(), gc.const_data_ptr(), grad_x.mutable_data_ptr(), r.rows, r.cols,
                             opb::dtype_of(yc, kBackward, "y"));
  return grad_x;
}

#ifdef OPB_WITH_CUDA

opb::softmax::Problem problem_of(const Tensor& t, const char* op, const char* arg, bool backward,
                                 std::initializer_list<const void*> ptrs) {
  const Rows r = rows_of(t, op, arg);
  opb::softmax::Problem p;
  p.rows = r.rows;
  p.cols = r.cols;
  p.dtype = opb::dtype_of(t, op, arg);
  p.backward = backward;
  p.device = t.get_device_index();
  p.vectorized = opb::softmax::vectorizable(p.cols, p.dtype, ptrs.begin(), static_cast<int>(ptrs.size()));
  return p;
}

opb::softmax::Plan plan_from(const std::vector<int64_t>& plan, const char* op) {
  STD_TORCH_CHECK(plan.size() == 4, op, ": plan must be [path, threads, vpt, cluster], got ", plan.size(),
                  " values");
  STD_TORCH_CHECK(plan[0] >= 0 && plan[0] <= 2, op,
                  ": plan[0] (path) must be 0 (warp), 1 (block) or 2 (split), got ", plan[0]);
  for (int i = 1; i < 4; ++i)
    STD_TORCH_CHECK(plan[i] >= 1 && plan[i] <= 1024, op, ": plan[", i, "] must be in 1..1024, got ", plan[i]);
  opb::softmax::Plan p;
  p.path = static_cast<opb::softmax::Path>(plan[0]);
  p.threads = static_cast<int>(plan[1]);
  p.vpt = static_cast<int>(plan[2]);
  p.cluster = static_cast<int>(plan[3]);
  return p;
}

// The split path's partial results; no tensor for the other paths (an allocation through the C shim is a
// dispatcher call, about a microsecond of a call that costs ten).
Tensor workspace_for(const Tensor& like, const opb::softmax::Plan& plan, const opb::softmax::Problem& p) {
  const size_t bytes = opb::softmax::workspace_bytes(plan, p);
  if (bytes == 0) return Tensor();
  return opb::new_tensor(like, {static_cast<int64_t>(bytes)}, opb::ScalarType::Byte);
}

void* data_or_null(Tensor& t) { return t.defined() ? t.mutable_data_ptr() : nullptr; }

Tensor forward_cuda_plan(const Tensor& x, const std::optional<opb::softmax::Plan>& chosen) {
  Tensor xc = prepare_forward(x);
  const auto guard = opb::device_guard(xc);
  Tensor y = opb::new_output(xc);
  const auto p = problem_of(xc, kForward, "x", false, {xc.const_data_ptr(), y.const_data_ptr()});
  if (p.rows == 0 || p.cols == 0) return y;
  const opb::softmax::Plan plan = chosen ? *chosen : opb::softmax::default_plan(p);
  const char* why = opb::softmax::plan_error(plan, p);
  STD_TORCH_CHECK(why == nullptr, kForward, ": plan cannot run rows=", p.rows, " cols=", p.cols, ": ", why);
  Tensor workspace = workspace_for(xc, plan, p);
  opb::check_launch(opb::softmax::forward(p, plan, xc.const_data_ptr(), y.mutable_data_ptr(),
                                          data_or_null(workspace), opb::stream_of(xc)),
                    kForward);
  return y;
}

Tensor backward_cuda_plan(const Tensor& y, const Tensor& grad_y, const std::optional<opb::softmax::Plan>& chosen) {
  auto [yc, gc] = prepare_backward(y, grad_y);
  const auto guard = opb::device_guard(yc);
  Tensor grad_x = opb::new_output(yc);
  const auto p = problem_of(yc, kBackward, "y", true,
                            {yc.const_data_ptr(), gc.const_data_ptr(), grad_x.const_data_ptr()});
  if (p.rows == 0 || p.cols == 0) return grad_x;
  const opb::softmax::Plan plan = chosen ? *chosen : opb::softmax::default_plan(p);
  const char* why = opb::softmax::plan_error(plan, p);
  STD_TORCH_CHECK(why == nullptr, kBackward, ": plan cannot run rows=", p.rows, " cols=", p.cols, ": ", why);
  Tensor workspace = workspace_for(yc, plan, p);
  opb::check_launch(opb::softmax::backward(p, plan, yc.const_data_ptr(), gc.const_data_ptr(),
                                           grad_x.mutable_data_ptr(), data_or_null(workspace),
                                           opb::stream_of(yc)),
                    kBackward);
  return grad_x;
}

Tensor forward_cuda(Tensor x) { return forward_cuda_plan(x, std::nullopt); }

Tensor backward_cuda(Tensor y, Tensor grad_y) { return backward_cuda_plan(y, grad_y, std::nullopt); }

Tensor forward_with_plan(Tensor x, std::vector<int64_t> plan) {
  return forward_cuda_plan(x, plan_from(plan, "softmax.forward_with_plan"));
}

Tensor backward_with_plan(Tensor y, Tensor grad_y, std::vector<int64_t> plan) {
  return backward_cuda_plan(y, grad_y, plan_from(plan, "softmax.backward_with_plan"));
}

std::vector<int64_t> default_plan(Tensor x, bool backward) {
  const char* op = "softmax.default_plan";
  opb::dtype_of(x, op, "x");
  const auto guard = opb::device_guard(x);
  // A contiguous tensor like x, and outputs fresh from the allocator (aligned).
  const void* ptr = x.is_contiguous() ? x.const_data_ptr() : nullptr;
  const auto p = problem_of(x, op, "x", backward, {ptr});
  const opb::softmax::Plan plan = opb::softmax::default_plan(p);
  return {static_cast<int64_t>(plan.path), plan.threads, plan.vpt, plan.cluster};
}

#endif

}  // namespace

OPB_LIBRARY(m) {
  m.def("forward(Tensor x) -> Tensor");
  m.def("forward.nograd(Tensor x) -> Tensor");
  m.def("backward(Tensor y, Tensor grad_y) -> Tensor");
  m.def("default_plan(Tensor x, bool backward) -> int[]");
  m.def("forward_with_plan(Tensor x, int[] plan) -> Tensor");
  m.def("backward_with_plan(Tensor y, Tensor grad_y, int[] plan) -> Tensor");
}

OPB_LIBRARY_IMPL(CPU, m) {
  m.impl("forward", TORCH_BOX(&forward_cpu));
  m.impl("forward.nograd", TORCH_BOX(&forward_cpu));
  m.impl("backward", TORCH_BOX(&backward_cpu));
}

#ifdef OPB_WITH_CUDA
OPB_LIBRARY_IMPL(CUDA, m) {
  m.impl("forward", TORCH_BOX(&forward_cuda));
  m.impl("forward.nograd", TORCH_BOX(&forward_cuda));
  m.impl("backward", TORCH_BOX(&backward_cuda));
  m.impl("default_plan", TORCH_BOX(&default_plan));
  m.impl("forward_with_plan", TORCH_BOX(&forward_with_plan));
  m.impl("backward_with_plan", TORCH_BOX(&backward_with_plan));
}
#endif
