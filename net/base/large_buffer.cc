#include "net/base/large_buffer.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>

#include "net/base/out_of_memory.h"

// Linux 5.14: fault in a whole range in one call. Older kernels refuse it (EINVAL), and the
// pages then fault in one by one as they are first written.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace qring::net {
namespace {
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kMapped = size_t{64} << 10;  // from here on: a mapping of its own
constexpr size_t kPage = 4096;
size_t round_up(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}
// Whole 4 KiB pages, not whole huge pages: a block a little over a multiple of 2 MiB (the MLP's
// 2.1 MB gradient) would otherwise map, and zero, almost twice what it uses; its tail is
// populated in 4 KiB pages. A job that keeps a result per step for a lagging rank makes one
// such block every step, and the kernel's zeroing of it was a third of a healthy rank's CPU.
size_t mapped_size(size_t bytes) {
  return round_up(bytes, kPage);
}
}  // namespace

void* alloc_large(size_t bytes) {
  if (bytes < kMapped) {
    void* p = std::aligned_alloc(64, round_up(std::max<size_t>(bytes, 1), 64));
    if (p == nullptr) throw AllocationFailed(bytes);
    return p;
  }
  const size_t size = mapped_size(bytes);
  char* p = nullptr;
  if (size >= kHugePage) {
    // One huge page more than needed, trimmed to start on a 2 MiB boundary and end at `size`.
    void* m =
        mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw AllocationFailed(bytes);
    auto* base = static_cast<char*>(m);
    p = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(base), kHugePage));
    if (p > base) munmap(base, size_t(p - base));
    if (char* end = base + size + kHugePage; end > p + size)
      munmap(p + size, size_t(end - (p + size)));
  } else {
    void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw AllocationFailed(bytes);
    p = static_cast<char*>(m);
  }
  // Every page now, in one call, rather than a fault per page as it is first written (a
  // fresh 1 MiB here: 2.8 ms page by page, 1.3 ms populated); huge pages from 2 MiB (advice:
  // without it the pages are 4 KiB, still correct).
  populate(p, size);
  return p;
}

void populate(void* p, size_t bytes) noexcept {
  const auto begin = reinterpret_cast<uintptr_t>(p), end = begin + bytes;
  const uintptr_t huge_begin = round_up(begin, kHugePage), huge_end = end / kHugePage * kHugePage;
  if (huge_end > huge_begin)
    madvise(reinterpret_cast<void*>(huge_begin), huge_end - huge_begin, MADV_HUGEPAGE);
  const uintptr_t page_begin = round_up(begin, kPage), page_end = end / kPage * kPage;
  if (page_end > page_begin)
    madvise(reinterpret_cast<void*>(page_begin), page_end - page_begin, MADV_POPULATE_WRITE);
}

void free_large(void* p, size_t bytes) noexcept {
  if (p == nullptr) return;
  if (bytes < kMapped) {
    std::free(p);
    return;
  }
  munmap(p, mapped_size(bytes));
}

}  // namespace qring::net
