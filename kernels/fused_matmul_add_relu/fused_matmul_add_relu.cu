// fused_matmul_add_relu launcher: one cuBLASLt matmul with a ReLU epilogue.
//
// torch tensors are row-major and cuBLASLt is column-major, so the launcher computes the transposed
// problem: out^T [n, m] = rhs^T [n, k] @ lhs^T [k, m]. A row-major [r, c] buffer read column-major is
// its own transpose, so no data moves: rhs becomes cuBLAS's A, lhs its B, out its D, and a vector
// bias of length n is cuBLASLt's per-row bias of D.
#include "fused_matmul_add_relu.cuh"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <array>
#include <climits>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace opb::fused_matmul_add_relu {
namespace {

// ---- handles: one per device, created on first use and kept for the process ----------------------

cublasStatus_t handle_for_current_device(cublasLtHandle_t* out) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return CUBLAS_STATUS_NOT_INITIALIZED;
  static std::mutex mutex;
  static std::vector<cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mutex);
  if (handles.size() <= static_cast<size_t>(device)) handles.resize(device + 1, nullptr);
  if (handles[device] == nullptr) {
    cublasStatus_t st = cublasLtCreate(&handles[device]);
    if (st != CUBLAS_STATUS_SUCCESS) {
      handles[device] = nullptr;
      return st;
    }
  }
  *out = handles[device];
  return CUBLAS_STATUS_SUCCESS;
}

// ---- descriptors, destroyed on every path out -----------------------------------------------------

struct MatmulDesc {
  cublasLtMatmulDesc_t d = nullptr;
  ~MatmulDesc() { if (d) cublasLtMatmulDescDestroy(d); }
};
struct Layout {
  cublasLtMatrixLayout_t d = nullptr;
  ~Layout() { if (d) cublasLtMatrixLayoutDestroy(d); }
};
struct Preference {
  cublasLtMatmulPreference_t d = nullptr;
  ~Preference() { if (d) cublasLtMatmulPreferenceDestroy(d); }
};

#define OPB_CUBLAS_TRY(expr)                                   \
  do {                                                         \
    cublasStatus_t st_ = (expr);                               \
    if (st_ != CUBLAS_STATUS_SUCCESS) return st_;              \
  } while (0)

template <typename T>
cublasStatus_t set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& value) {
  return cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value));
}
template <typename T>
cublasStatus_t set_layout(cublasLtMatrixLayout_t d, cublasLtMatrixLayoutAttribute_t attr, const T& value) {
  return cublasLtMatrixLayoutSetAttribute(d, attr, &value, sizeof(value));
}
template <typename T>
cublasStatus_t set_pref(cublasLtMatmulPreference_t d, cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
  return cublasLtMatmulPreferenceSetAttribute(d, attr, &value, sizeof(value));
}

// A column-major [rows, cols] layout with leading dimension ld, batched when batch > 1.
cublasStatus_t make_layout(Layout& l, cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int32_t batch,
                           int64_t batch_stride) {
  OPB_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&l.d, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld));
  if (batch > 1) {
    OPB_CUBLAS_TRY(set_layout(l.d, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, batch));
    OPB_CUBLAS_TRY(set_layout(l.d, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, batch_stride));
  }
  return CUBLAS_STATUS_SUCCESS;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::Float32: return CUDA_R_32F;
    case DType::Float16: return CUDA_R_16F;
    case DType::BFloat16: return CUDA_R_16BF;
    case DType::Float64: return CUDA_R_64F;
  }
  return CUDA_R_32F;
}

// The largest power of two up to 256 that divides the address: what the heuristic may assume.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align >>= 1;
  return align;
}

// ---- what a call needs besides its pointers, cached per problem ----------------------------------
//
// A problem's key is every value its descriptor, layouts and algorithm depend on (shapes, strides,
// types, the epilogue, the operands' alignments, the workspace). The algorithm (the heuristic costs more
// host time than a small GEMM) is kept once per process; the descriptor and the four layouts once per
// thread, since the bias pointer, set on the descriptor before each call, is the only attribute a call
// changes. Both caches are bounded: when full they start again.

using Key = std::array<int64_t, 22>;
struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    size_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
    return h;
  }
};
struct Choice {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_bytes = 0;  // what the algorithm needs, at most the preference's maximum
};

std::mutex cache_mutex;
std::unordered_map<Key, Choice, KeyHash> algo_cache;
constexpr size_t kMaxCached = 4096;

// The column-major problem, as cuBLASLt sees it.
struct Plan {
  cublasOperation_t op_a, op_b;
  int64_t a_rows, a_cols, b_rows, b_cols;
  cublasLtEpilogue_t epilogue;
  bool c_in_place;
  bool c_separate;
};

// A problem's descriptor and layouts (C's only where C is a tensor of its own).
struct Prepared {
  MatmulDesc desc;
  Layout a, b, c, d;
  cublasLtMatrixLayout_t c_layout() const { return c.d ? c.d : d.d; }
};

constexpr size_t kMaxPrepared = 256;

cublasStatus_t prepare(Prepared& s, const Problem& p, const Plan& plan, cublasComputeType_t compute,
                       cudaDataType_t scale_type) {
  const cudaDataType_t type = cuda_type(p.dtype);
  const int32_t batch = static_cast<int32_t>(p.batch);
  OPB_CUBLAS_TRY(cublasLtMatmulDescCreate(&s.desc.d, compute, scale_type));
  OPB_CUBLAS_TRY(set_desc(s.desc.d, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(plan.op_a)));
  OPB_CUBLAS_TRY(set_desc(s.desc.d, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(plan.op_b)));
  // Bias type defaults to D's type; BIAS_BATCH_STRIDE defaults to 0: one vector for every batch entry.
  OPB_CUBLAS_TRY(set_desc(s.desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE, plan.epilogue));
  OPB_CUBLAS_TRY(make_layout(s.a, type, plan.a_rows, plan.a_cols, p.rhs.ld, batch, p.rhs.batch_stride));
  OPB_CUBLAS_TRY(make_layout(s.b, type, plan.b_rows, plan.b_cols, p.lhs.ld, batch, p.lhs.batch_stride));
  OPB_CUBLAS_TRY(make_layout(s.d, type, p.n, p.m, p.n, batch, p.m * p.n));
  if (plan.c_separate) OPB_CUBLAS_TRY(make_layout(s.c, type, p.n, p.m, p.n, batch, p.c_batch_stride));
  return CUBLAS_STATUS_SUCCESS;
}

// This thread's descriptor and layouts for `key`, made on first use; nullptr with *st set if cuBLASLt
// refused one (nothing is kept then).
Prepared* prepared_for(const Key& key, const Problem& p, const Plan& plan, cublasComputeType_t compute,
                       cudaDataType_t scale_type, cublasStatus_t* st) {
  thread_local std::unordered_map<Key, std::unique_ptr<Prepared>, KeyHash> prepared;
  auto it = prepared.find(key);
  if (it != prepared.end()) return it->second.get();
  auto made = std::make_unique<Prepared>();
  *st = prepare(*made, p, plan, compute, scale_type);
  if (*st != CUBLAS_STATUS_SUCCESS) return nullptr;
  if (prepared.size() >= kMaxPrepared) prepared.clear();
  return prepared.emplace(key, std::move(made)).first->second.get();
}

cublasStatus_t choose(Choice* choice, const Key& key, cublasLtHandle_t handle, const Prepared& s, const Problem& p,
                      size_t workspace_bytes, const std::array<uint32_t, 4>& align) {
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto it = algo_cache.find(key);
    if (it != algo_cache.end()) {
      *choice = it->second;
      return CUBLAS_STATUS_SUCCESS;
    }
  }
  Preference pref;
  OPB_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&pref.d));
  OPB_CUBLAS_TRY(set_pref(pref.d, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(workspace_bytes)));
  // The heuristic cannot see A-D's addresses; without these it may pick a kernel that needs more
  // alignment than a sliced or offset tensor has.
  OPB_CUBLAS_TRY(set_pref(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align[0]));
  OPB_CUBLAS_TRY(set_pref(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align[1]));
  OPB_CUBLAS_TRY(set_pref(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align[2]));
  OPB_CUBLAS_TRY(set_pref(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align[3]));
  if (p.dtype == DType::Float16 || p.dtype == DType::BFloat16) {
    // Split-K partial sums stay in fp32: never reduced in the 16-bit output type.
    const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_MASK & ~CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
    OPB_CUBLAS_TRY(set_pref(pref.d, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, mask));
  }
  cublasLtMatmulHeuristicResult_t result;
  std::memset(&result, 0, sizeof(result));
  int returned = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, s.desc.d, s.a.d, s.b.d, s.c_layout(), s.d.d, pref.d, 1,
                                                     &result, &returned);
  if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED) return st;
  choice->found = st == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS;
  if (choice->found) {
    choice->algo = result.algo;
    choice->workspace_bytes = result.workspaceSize;
  }
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (algo_cache.size() >= kMaxCached) algo_cache.clear();
  algo_cache.emplace(key, *choice);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t run(const Problem& p, const Workspace& workspace, cudaStream_t stream, bool* found) {
  *found = true;
  constexpr size_t workspace_bytes = Workspace::kMaxBytes;
  cublasLtHandle_t handle = nullptr;
  OPB_CUBLAS_TRY(handle_for_current_device(&handle));
  int device = 0;
  cudaGetDevice(&device);

  const bool fp64 = p.dtype == DType::Float64;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  if (fp64) compute = CUBLAS_COMPUTE_64F;
  if (p.dtype == DType::Float32 && p.allow_tf32) compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  const cudaDataType_t scale_type = fp64 ? CUDA_R_64F : CUDA_R_32F;

  Plan plan;
  // A = rhs^T as [n, k]: a row-major rhs is that matrix read column-major; a transposed one needs op T.
  plan.op_a = p.rhs.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  plan.a_rows = p.rhs.transposed ? p.k : p.n;
  plan.a_cols = p.rhs.transposed ? p.n : p.k;
  // B = lhs^T as [k, m].
  plan.op_b = p.lhs.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  plan.b_rows = p.lhs.transposed ? p.m : p.k;
  plan.b_cols = p.lhs.transposed ? p.k : p.m;
  plan.epilogue = p.bias_vector ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
  plan.c_in_place = p.c != nullptr && p.c == p.out;
  plan.c_separate = p.c != nullptr && p.c != p.out;
  const void* c_ptr = p.c ? p.c : p.out;

  const std::array<uint32_t, 4> align = {alignment_of(p.rhs.data), alignment_of(p.lhs.data), alignment_of(c_ptr),
                                         alignment_of(p.out)};
  const Key key = {device, static_cast<int64_t>(p.dtype), compute, plan.epilogue, p.batch, p.m, p.n, p.k,
                   plan.op_a, plan.op_b, p.rhs.ld, p.lhs.ld, p.rhs.batch_stride, p.lhs.batch_stride,
                   plan.c_in_place, plan.c_separate ? p.c_batch_stride : -1, align[0], align[1], align[2], align[3],
                   p.bias_vector ? alignment_of(p.bias_vector) : 0, static_cast<int64_t>(workspace_bytes)};

  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  Prepared* s = prepared_for(key, p, plan, compute, scale_type, &st);
  if (s == nullptr) return st;
  // The one attribute a call changes; the descriptor is this thread's alone.
  if (p.bias_vector) OPB_CUBLAS_TRY(set_desc(s->desc.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias_vector));

  Choice choice;
  OPB_CUBLAS_TRY(choose(&choice, key, handle, *s, p, workspace_bytes, align));
  if (!choice.found) {
    *found = false;
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }

  // Only what the chosen algorithm asks for (small problems usually need none): each allocation is a
  // dispatcher call in the binding, and a 32 MiB one per call also raised the peak memory.
  void* ws = nullptr;
  if (choice.workspace_bytes > 0) ws = workspace.get(workspace.ctx, choice.workspace_bytes);
  const float alpha32 = 1.f, beta32 = p.c ? 1.f : 0.f;
  const double alpha64 = 1.0, beta64 = p.c ? 1.0 : 0.0;
  const void* alpha = fp64 ? static_cast<const void*>(&alpha64) : static_cast<const void*>(&alpha32);
  const void* beta = fp64 ? static_cast<const void*>(&beta64) : static_cast<const void*>(&beta32);
  return cublasLtMatmul(handle, s->desc.d, alpha, p.rhs.data, s->a.d, p.lhs.data, s->b.d, beta, c_ptr, s->c_layout(),
                        p.out, s->d.d, &choice.algo, ws, choice.workspace_bytes, stream);
}

bool fits_int32(const Problem& p) {
  const int64_t dims[] = {p.batch, p.m, p.n, p.k, p.lhs.ld, p.rhs.ld};
  for (int64_t v : dims) {
    if (v > INT_MAX) return false;
  }
  return true;
}

}  // namespace

Result launch(const Problem& p, const Workspace& workspace, cudaStream_t stream) {
  // cuBLASLt takes int32 sizes in practice; larger problems go to the caller's fallback.
  if (!fits_int32(p)) return {Status::NotSupported, "a size does not fit in int32"};
  bool found = true;
  cublasStatus_t st = run(p, workspace, stream, &found);
  if (!found || st == CUBLAS_STATUS_NOT_SUPPORTED) return {Status::NotSupported, cublasLtGetStatusString(st)};
  if (st != CUBLAS_STATUS_SUCCESS) return {Status::Failed, cublasLtGetStatusString(st)};
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return {Status::Failed, cudaGetErrorString(err)};
  return {Status::Ok, ""};
}

bool tf32_math(void* cublas_handle) {
  cublasMath_t mode = CUBLAS_DEFAULT_MATH;
  if (cublas_handle == nullptr) return false;
  if (cublasGetMathMode(static_cast<cublasHandle_t>(cublas_handle), &mode) != CUBLAS_STATUS_SUCCESS) return false;
  // The low bits are the math mode; CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION is a flag above them.
  return (static_cast<int>(mode) & 0xf) == CUBLAS_TF32_TENSOR_OP_MATH;
}

}  // namespace opb::fused_matmul_add_relu
