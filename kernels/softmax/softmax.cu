// softmax's plans: which kernel and launch shape a problem gets, and whether a given plan can run it.
#include <algorithm>
#include <mutex>

#include "softmax_launch.cuh"

namespace opb::softmax {
namespace {

// Built with the same flags as the real kernels: its attributes say what they were built for.
__global__ void probe_kernel() {}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

bool is_pow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

DeviceInfo query(int device) {
  DeviceInfo info;
  int sms = 1, major = 0, cluster_launch = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) sms = 1;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) major = 0;
  if (cudaDeviceGetAttribute(&cluster_launch, cudaDevAttrClusterLaunch, device) != cudaSuccess) cluster_launch = 0;
  cudaFuncAttributes attr = {};
  // PTX built for an older arch and JIT-compiled here has no cluster code in it: both versions count.
  const bool built_for_clusters = cudaFuncGetAttributes(&attr, probe_kernel) == cudaSuccess &&
                                  attr.ptxVersion >= 90 && attr.binaryVersion >= 90;
  cudaGetLastError();  // a failed query above must not surface as the next launch's error
  info.sms = sms > 0 ? sms : 1;
  info.clusters = major >= 9 && cluster_launch != 0 && built_for_clusters;
  return info;
}

// A block that holds `vectors` vectors of a row with `vpt` of them a thread: a power-of-two count of
// threads in 64..256 when that is enough, else a multiple of 32 up to 1024.
Plan block_shape(int64_t vectors, int vpt) {
  Plan plan;
  plan.path = Path::Block;
  plan.cluster = 1;
  const int64_t threads = ceil_div(vectors, vpt);
  if (threads <= 256) {
    plan.threads = static_cast<int>(std::max<int64_t>(64, next_pow2(threads)));
    plan.vpt = static_cast<int>(next_pow2(ceil_div(vectors, plan.threads)));
  } else {
    plan.threads = static_cast<int>(ceil_div(threads, 32) * 32);
    plan.vpt = vpt;
  }
  return plan;
}

}  // namespace

DeviceInfo device_info(int device) {
  constexpr int kMaxDevices = 64;
  if (device < 0 || device >= kMaxDevices) return query(device);
  static std::mutex mutex;
  static DeviceInfo infos[kMaxDevices];
  static bool known[kMaxDevices] = {};
  std::lock_guard<std::mutex> lock(mutex);
  if (!known[device]) {
    infos[device] = query(device);
    known[device] = true;
  }
  return infos[device];
}

bool vectorizable(int64_t cols, DType dtype, const void* const* ptrs, int n_ptrs) {
  if (cols % (16 / elem_bytes(dtype)) != 0) return false;
  for (int i = 0; i < n_ptrs; ++i)
    if (reinterpret_cast<uintptr_t>(ptrs[i]) % 16 != 0) return false;
  return true;
}

// Measured (benchmarks/tune_softmax.py and benchmarks/tuning/issue14.py on an H100, NOTES.md; the
// backward first on an H200): rows that fit a block of up to 256 threads hold 4 vectors a thread (backward
// 2), longer rows 8 (backward 4) with up to 1024 threads; both beat splitting a row across a cluster:
// fp32 32768 cols 1024x8 0.99 of copy (cluster 2x512x8 0.93); bf16 32768 cols 512x8 0.98 (cluster
// 2x256x8 0.93). Two exceptions, each where it was measured:
//  * forward, float32 rows of 513..1024 vectors: 128 threads of 8 (more rows in flight on an SM):
//    4096 cols 48.4 us against 256x4's 49.6; 3000 cols and 8192 rows of 4096 equal.
//  * backward, 16-byte rows of 257..512 vectors: one vector a thread (the backward wants threads):
//    bf16 4096 cols 512x1 265 us = 1.00 of copy against 256x2's 284, bf16 3072 cols 384x1 103 against
//    120, fp32 2048 cols 266 against 268.
Plan default_plan(const Problem& p) {
  const int64_t vectors = row_vectors(p);
  const int small_vpt = p.backward ? 2 : 4;
  const int big_vpt = p.backward ? kBigVptBackward : kBigVptForward;
  Plan plan;

  // Short rows: a group of lanes per row, no shared memory, no __syncthreads.
  if (p.dtype != DType::Float64 && vectors <= 32 * 4) {
    plan.path = Path::Warp;
    plan.threads = vectors <= 32 ? static_cast<int>(next_pow2(std::max<int64_t>(vectors, 1))) : 32;
    plan.vpt = vectors <= 32 ? 1 : static_cast<int>(next_pow2(ceil_div(vectors, 32)));
    plan.cluster = 1;
    return plan;
  }
  const bool wide = p.vectorized && p.dtype != DType::Float64;
  if (p.backward && wide && vectors > 256 && vectors <= 512) return block_shape(vectors, 1);
  if (!p.backward && wide && p.dtype == DType::Float32 && vectors > 512 && vectors <= 1024)
    return block_shape(vectors, big_vpt);  // 128 threads of 8
  if (vectors <= 256 * small_vpt) return block_shape(vectors, small_vpt);
  const int64_t block_vectors = int64_t(1024) * big_vpt;
  if (vectors <= block_vectors) return block_shape(vectors, big_vpt);

  // Longer rows stay on chip split across a cluster, when there are rows enough to fill the device.
  const DeviceInfo info = device_info(p.device);
  const int64_t cluster = ceil_div(vectors, block_vectors);
  if (info.clusters && cluster <= 8 && p.rows * cluster >= info.sms) {
    plan = block_shape(ceil_div(vectors, cluster), big_vpt);
    plan.cluster = static_cast<int>(cluster);
    return plan;
  }

  // Otherwise chunks small enough that the grid still fills the device; x is read twice.
  plan.path = Path::Split;
  plan.vpt = kSplitVpt;
  plan.cluster = 1;
  plan.threads = 256;
  while (plan.threads > 64 && p.rows * split_count(plan, p) < 2 * int64_t(info.sms)) plan.threads /= 2;
  return plan;
}

const char* plan_error(const Plan& plan, const Problem& p) {
  const int64_t vectors = row_vectors(p);
  switch (plan.path) {
    case Path::Warp:
      if (p.dtype == DType::Float64) return "the warp path has no float64 build";
      if (!is_pow2(plan.threads) || plan.threads > 32)
        return "warp path: threads (lanes per row) must be 1, 2, 4, 8, 16 or 32";
      if (plan.vpt != 1 && plan.vpt != 2 && plan.vpt != 4) return "warp path: vpt must be 1, 2 or 4";
      if (plan.cluster != 1) return "warp path: cluster must be 1";
      if (int64_t(plan.threads) * plan.vpt < vectors) return "warp path: threads * vpt vectors do not cover a row";
      return nullptr;
    case Path::Block: {
      const int big_vpt = p.backward ? kBigVptBackward : kBigVptForward;
      if (plan.vpt != 1 && plan.vpt != 2 && plan.vpt != 4 && plan.vpt != 8)
        return "block path: vpt must be 1, 2, 4 or 8";
      if (plan.threads < 32 || plan.threads % 32 != 0) return "block path: threads must be a positive multiple of 32";
      const bool big_ok = plan.vpt == big_vpt || (p.backward && plan.vpt == 1);
      if (plan.threads > 1024 || (plan.threads > 256 && !big_ok))
        return p.backward ? "block path: threads must be <= 256, or <= 1024 with vpt 1 or 4"
                          : "block path: threads must be <= 256, or <= 1024 with vpt 8";
      if (plan.cluster < 1 || plan.cluster > 8) return "block path: cluster must be 1..8";
      if (plan.cluster > 1 && !device_info(p.device).clusters)
        return "block path: cluster > 1 needs an sm_90+ GPU and kernels built for it";
      if (int64_t(plan.threads) * plan.vpt * plan.cluster < vectors)
        return "block path: threads * vpt * cluster vectors do not cover a row";
      return nullptr;
    }
    case Path::Split:
      if (plan.threads < 32 || plan.threads > 256 || plan.threads % 32 != 0)
        return "split path: threads must be a multiple of 32 in 32..256";
      if (plan.vpt != kSplitVpt) return "split path: vpt must be 4";
      if (plan.cluster != 1) return "split path: cluster must be 1";
      return nullptr;
  }
  return "unknown path (0 warp, 1 block, 2 split)";
}

size_t workspace_bytes(const Plan& plan, const Problem& p) {
  if (plan.path != Path::Split) return 0;
  const size_t acc = p.dtype == DType::Float64 ? 8 : 4;
  const size_t per_partial = p.backward ? acc : 2 * acc;
  return static_cast<size_t>(p.rows) * static_cast<size_t>(split_count(plan, p)) * per_partial;
}

}  // namespace opb::softmax
