// The element types a launcher accepts, shared by the torch-facing binding (.cpp) and the CUDA
// launcher (.cu), which includes no torch header.
#pragma once

namespace opb {

enum class DType : int { Float32 = 0, Float16 = 1, BFloat16 = 2, Float64 = 3 };

// Bytes an element of `dtype` takes.
constexpr int elem_bytes(DType dtype) {
  switch (dtype) {
    case DType::Float32: return 4;
    case DType::Float16: return 2;
    case DType::BFloat16: return 2;
    case DType::Float64: return 8;
  }
  return 4;
}

}  // namespace opb
