// What both binding headers (<opbuilder/stable.h>, <opbuilder/binding.h>) give a fresh CPU output; no torch header.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace opb {

// A hint for a fresh CPU buffer: back it with transparent huge pages before the first write. On Linux
// with THP in "madvise" mode a fresh 64 MB output otherwise costs 16384 page faults, which can take
// longer than the op itself. A hint only: errors are ignored.
inline void advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (data == nullptr || bytes < 2 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace opb
