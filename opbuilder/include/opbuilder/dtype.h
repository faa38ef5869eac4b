// The element types a launcher accepts, shared by the torch-facing binding (.cpp) and the CUDA
// launcher (.cu), which includes no torch header.
#pragma once

namespace opb {

enum class DType : int { Float32 = 0, Float16 = 1, BFloat16 = 2, Float64 = 3 };

}  // namespace opb
