// The accumulation type of each storage type: double for double data, float otherwise (half,
// bfloat16, float). Plain C++, for CPU kernels and device code alike.
#pragma once

namespace opb {

template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};
template <typename T>
using acc_t = typename AccOf<T>::type;

}  // namespace opb
