// softmax as Torch ops: schemas, input checks, CPU and CUDA implementations.
//
//   forward(x) -> y                     softmax over x's last dim
//   backward(y, grad_y) -> grad_x       grad_x = y * (grad_y - sum(grad_y * y, -1))
// CUDA only, for tests and tuning (a plan is [path, threads, vpt, cluster]; softmax.cuh explains it):
//   default_plan(x, backward) -> int[]  the plan forward/backward would use for a tensor like x
//   forward_with_plan(x, plan) -> y
//   backward_with_plan(y, grad_y, plan) -> grad_x
#include <opbuilder/binding.h>


#include "softmax_cpu.h"
#ifdef OPB_WITH_CUDA
#include "softmax.cuh"
#endif

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr const char* kForward = "softmax.forward";
constexpr const char* kBackward = "softmax.backward";

// rows x cols view of a contiguous tensor whose last dim is cols.
struct Rows {
  int64_t rows;
  int64_t cols;
};

// "[4, 8]", built here rather than by streaming IntArrayRef into TORCH_CHECK: on the GPU machine
// (torch 2.11) the one check of this op whose message streamed sizes crashed the process instead of
// raising. The cause is not pinned down; this avoids the construct.
std::string shape_of(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t d = 0; d < t.dim(); ++d) out += (d ? ", " : "") + std::to_string(t.size(d));
  return out + "]";
}

Rows rows_of(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.dim() >= 1, op, ": ", arg, " must have at least 1 dim (the softmax dim), got a 0-d tensor");
  const int64_t cols = t.size(-1);
  return {cols == 0 ? 0 : t.numel() / cols, cols};
}

at::Tensor prepare_forward(const at::Tensor& x) {
  opb::dtype_of(x, kForward, "x");
  rows_of(x, kForward, "x");
  return x.contiguous();
}

std::pair<at::Tensor, at::Tensor> prepare_backward(const at::Tensor& y, const at::Tensor& grad_y) {
  opb::dtype_of(y, kBackward, "y");
  rows_of(y, kBackward, "y");
  TORCH_CHECK(grad_y.scalar_type() == y.scalar_type(), kBackward, ": grad_y must have y's dtype ", y.scalar_type(),
              ", got ", grad_y.scalar_type());
  TORCH_CHECK(grad_y.device() == y.device(), kBackward, ": grad_y must be on y's device ", y.device(), ", got ",
              grad_y.device());
  TORCH_CHECK(grad_y.sizes().equals(y.sizes()), kBackward, ": grad_y must have y's shape ", shape_of(y), ", got ",
              shape_of(grad_y));
  return {y.contiguous(), grad_y.contiguous()};
}

at::Tensor forward_cpu(const at::Tensor& x) {
  at::Tensor xc = prepare_forward(x);
  at::Tensor y = opb::new_output(xc);
  const Rows r = rows_of(xc, kForward, "x");
  opb::softmax::forward_cpu(xc.const_data_ptr(), y.mutable_data_ptr(), r.rows, r.cols,
                            opb::dtype_of(xc, kForward, "x"));
  return y;
}

at::Tensor backward_cpu(const at::Tensor& y, const at::Tensor& grad_y) {
  auto [yc, gc] = prepare_backward(y, grad_y);
  at::Tensor grad_x = opb::new_output(yc);
  const Rows r = rows_of(yc, kBackward, "y");
  opb::softmax::backward_cpu(yc.const_data_ptr(), gc.const_data_ptr(), grad_x.mutable_data_ptr(), r.rows, r.cols,
                             opb::dtype_of(yc, kBackward, "y"));
  return grad_x;
}

#ifdef OPB_WITH_CUDA

opb::softmax::Problem problem_of(const at::Tensor& t, const char* op, const char* arg, bool backward,
                                 std::initializer_list<const void*> ptrs) {
  const Rows r = rows_of(t, op, arg);
  opb::softmax::Problem p;
  p.rows = r.rows;
  p.cols = r.cols;
  p.dtype = opb::dtype_of(t, op, arg);
  p.backward = backward;
  p.device = t.device().index();
  p.vectorized = opb::softmax::vectorizable(p.cols, p.dtype, ptrs.begin(), static_cast<int>(ptrs.size()));
  return p;
}

opb::softmax::Plan plan_from(c10::IntArrayRef plan, const char* op) {
  TORCH_CHECK(plan.size() == 4, op, ": plan must be [path, threads, vpt, cluster], got ", plan.size(), " values");
  TORCH_CHECK(plan[0] >= 0 && plan[0] <= 2, op, ": plan[0] (path) must be 0 (warp), 1 (block) or 2 (split), got ",
              plan[0]);
  for (int i = 1; i < 4; ++i)
    TORCH_CHECK(plan[i] >= 1 && plan[i] <= 1024, op, ": plan[", i, "] must be in 1..1024, got ", plan[i]);
  opb::softmax::Plan p;
  p.path = static_cast<opb::softmax::Path>(plan[0]);
  p.threads = static_cast<int>(plan[1]);
  p.vpt = static_cast<int>(plan[2]);
  p.cluster = static_cast<int>(plan[3]);
  return p;
}

at::Tensor workspace_for(const at::Tensor& like, const opb::softmax::Plan& plan, const opb::softmax::Problem& p) {
  const size_t bytes = opb::softmax::workspace_bytes(plan, p);
  return like.new_empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

at::Tensor forward_cuda_plan(const at::Tensor& x, const std::optional<opb::softmax::Plan>& chosen) {
  at::Tensor xc = prepare_forward(x);
  c10::cuda::CUDAGuard guard(xc.device());
  at::Tensor y = opb::new_output(xc);
  const auto p = problem_of(xc, kForward, "x", false, {xc.const_data_ptr(), y.const_data_ptr()});
  if (p.rows == 0 || p.cols == 0) return y;
  const opb::softmax::Plan plan = chosen ? *chosen : opb::softmax::default_plan(p);
  const char* why = opb::softmax::plan_error(plan, p);
  TORCH_CHECK(why == nullptr, kForward, ": plan cannot run rows=", p.rows, " cols=", p.cols, ": ", why);
  at::Tensor workspace = workspace_for(xc, plan, p);
  opb::check_launch(opb::softmax::forward(p, plan, xc.const_data_ptr(), y.mutable_data_ptr(),
                                          workspace.mutable_data_ptr(), opb::stream_of(xc)),
                    kForward);
  return y;
}

at::Tensor backward_cuda_plan(const at::Tensor& y, const at::Tensor& grad_y,
                              const std::optional<opb::softmax::Plan>& chosen) {
  auto [yc, gc] = prepare_backward(y, grad_y);
  c10::cuda::CUDAGuard guard(yc.device());
  at::Tensor grad_x = yc.new_empty(yc.sizes());
  const auto p = problem_of(yc, kBackward, "y", true,
                            {yc.const_data_ptr(), gc.const_data_ptr(), grad_x.const_data_ptr()});
  if (p.rows == 0 || p.cols == 0) return grad_x;
  const opb::softmax::Plan plan = chosen ? *chosen : opb::softmax::default_plan(p);
  const char* why = opb::softmax::plan_error(plan, p);
  TORCH_CHECK(why == nullptr, kBackward, ": plan cannot run rows=", p.rows, " cols=", p.cols, ": ", why);
  at::Tensor workspace = workspace_for(yc, plan, p);
  opb::check_launch(opb::softmax::backward(p, plan, yc.const_data_ptr(), gc.const_data_ptr(),
                                           grad_x.mutable_data_ptr(), workspace.mutable_data_ptr(),
                                           opb::stream_of(yc)),
                    kBackward);
  return grad_x;
}

at::Tensor forward_cuda(const at::Tensor& x) { return forward_cuda_plan(x, std::nullopt); }

at::Tensor backward_cuda(const at::Tensor& y, const at::Tensor& grad_y) {
  return backward_cuda_plan(y, grad_y, std::nullopt);
}

at::Tensor forward_with_plan(const at::Tensor& x, c10::IntArrayRef plan) {
  return forward_cuda_plan(x, plan_from(plan, "softmax.forward_with_plan"));
}

at::Tensor backward_with_plan(const at::Tensor& y, const at::Tensor& grad_y, c10::IntArrayRef plan) {
  return backward_cuda_plan(y, grad_y, plan_from(plan, "softmax.backward_with_plan"));
}

std::vector<int64_t> default_plan(const at::Tensor& x, bool backward) {
  const char* op = "softmax.default_plan";
  opb::dtype_of(x, op, "x");
  c10::cuda::CUDAGuard guard(x.device());
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
  m.def("backward(Tensor y, Tensor grad_y) -> Tensor");
  m.def("default_plan(Tensor x, bool backward) -> int[]");
  m.def("forward_with_plan(Tensor x, int[] plan) -> Tensor");
  m.def("backward_with_plan(Tensor y, Tensor grad_y, int[] plan) -> Tensor");
}

OPB_LIBRARY_IMPL(CPU, m) {
  m.impl("forward", &forward_cpu);
  m.impl("backward", &backward_cpu);
}

#ifdef OPB_WITH_CUDA
OPB_LIBRARY_IMPL(CUDA, m) {
  m.impl("forward", &forward_cuda);
  m.impl("backward", &backward_cuda);
  m.impl("default_plan", &default_plan);
  m.impl("forward_with_plan", &forward_with_plan);
  m.impl("backward_with_plan", &backward_with_plan);
}
#endif
