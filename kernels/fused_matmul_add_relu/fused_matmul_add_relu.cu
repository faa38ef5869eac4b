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

// ---- algorithm choice, cached: the heuristic costs more host time than a small GEMM -------------

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

cublasStatus_t run(const Problem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream, bool* found) {
  *found = true;
  cublasLtHandle_t handle = nullptr;
  OPB_CUBLAS_TRY(handle_for_current_device(&handle));
  int device = 0;
  cudaGetDevice(&device);

  const cudaDataType_t type = cuda_type(p.dtype);
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

  const int32_t batch = static_cast<int32_t>(p.batch);
  const int64_t out_batch_stride = p.m * p.n;

  MatmulDesc desc;
  OPB_CUBLAS_TRY(cublasLtMatmulDescCreate(&desc.d, compute, scale_type));
  OPB_CUBLAS_TRY(set_desc(desc.d, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(plan.op_a)));
  OPB_CUBLAS_TRY(set_desc(desc.d, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(plan.op_b)));
  OPB_CUBLAS_TRY(set_desc(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE, plan.epilogue));
  if (p.bias_vector) {
    // Bias type defaults to D's type; BIAS_BATCH_STRIDE defaults to 0: one vector for every batch entry.
    OPB_CUBLAS_TRY(set_desc(desc.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias_vector));
  }

  Layout a, b, c, d;
  OPB_CUBLAS_TRY(make_layout(a, type, plan.a_rows, plan.a_cols, p.rhs.ld, batch, p.rhs.batch_stride));
  OPB_CUBLAS_TRY(make_layout(b, type, plan.b_rows, plan.b_cols, p.lhs.ld, batch, p.lhs.batch_stride));
  OPB_CUBLAS_TRY(make_layout(d, type, p.n, p.m, p.n, batch, out_batch_stride));
  if (plan.c_separate) OPB_CUBLAS_TRY(make_layout(c, type, p.n, p.m, p.n, batch, p.c_batch_stride));
  cublasLtMatrixLayout_t c_layout = plan.c_separate ? c.d : d.d;
  const void* c_ptr = p.c ? p.c : p.out;

  const uint32_t align_a = alignment_of(p.rhs.data), align_b = alignment_of(p.lhs.data);
  const uint32_t align_c = alignment_of(c_ptr), align_d = alignment_of(p.out);
  const Key key = {device, static_cast<int64_t>(p.dtype), compute, plan.epilogue, p.batch, p.m, p.n, p.k,
                   plan.op_a, plan.op_b, p.rhs.ld, p.lhs.ld, p.rhs.batch_stride, p.lhs.batch_stride,
                   plan.c_in_place, plan.c_separate ? p.c_batch_stride : -1, align_a, align_b, align_c, align_d,
                   p.bias_vector ? alignment_of(p.bias_vector) : 0, static_cast<int64_t>(workspace_bytes)};

  Choice choice;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto it = algo_cache.find(key);
    if (it != algo_cache.end()) {
      choice = it->second;
      cached = true;
    }
  }
  if (!cached) {
    Preference pref;
    OPB_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&pref.d));
    OPB_CUBLAS_TRY(set_pref(pref.d, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(workspace_bytes)));
    // The heuristic cannot see A-D's addresses; without these it may pick a kernel that needs more
    // alignment than a sliced or offset tensor has.
    OPB_CUBLAS_TRY(set_pref(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a));
    OPB_CUBLAS_TRY(set_pref(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b));
    OPB_CUBLAS_TRY(set_pref(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c));
    OPB_CUBLAS_TRY(set_pref(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d));
    if (p.dtype == DType::Float16 || p.dtype == DType::BFloat16) {
      // Split-K partial sums stay in fp32: never reduced in the 16-bit output type.
      const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_MASK & ~CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
      OPB_CUBLAS_TRY(set_pref(pref.d, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, mask));
    }
    cublasLtMatmulHeuristicResult_t result;
    std::memset(&result, 0, sizeof(result));
    int returned = 0;
    cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(handle, desc.d, a.d, b.d, c_layout, d.d, pref.d, 1, &result, &returned);
    if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED) return st;
    choice.found = st == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS;
    if (choice.found) choice.algo = result.algo;
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (algo_cache.size() >= kMaxCached) algo_cache.clear();
    algo_cache.emplace(key, choice);
  }
  if (!choice.found) {
    *found = false;
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }

  const float alpha32 = 1.f, beta32 = p.c ? 1.f : 0.f;
  const double alpha64 = 1.0, beta64 = p.c ? 1.0 : 0.0;
  const void* alpha = fp64 ? static_cast<const void*>(&alpha64) : static_cast<const void*>(&alpha32);
  const void* beta = fp64 ? static_cast<const void*>(&beta64) : static_cast<const void*>(&beta32);
  return cublasLtMatmul(handle, desc.d, alpha, p.rhs.data, a.d, p.lhs.data, b.d, beta, c_ptr, c_layout, p.out, d.d,
                        &choice.algo, workspace, workspace_bytes, stream);
}

bool fits_int32(const Problem& p) {
  const int64_t dims[] = {p.batch, p.m, p.n, p.k, p.lhs.ld, p.rhs.ld};
  for (int64_t v : dims) {
    if (v > INT_MAX) return false;
  }
  return true;
}

}  // namespace

Result launch(const Problem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  // cuBLASLt takes int32 sizes in practice; larger problems go to the caller's fallback.
  if (!fits_int32(p)) return {Status::NotSupported, "a size does not fit in int32"};
  bool found = true;
  cublasStatus_t st = run(p, workspace, workspace_bytes, stream, &found);
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
