// Memory for large buffers that are filled soon after they are made: datasets, the quorum
// all-reduce's kept results. On a virtual machine a page fault costs microseconds (188 MB in
// 4 KiB pages took 0.7 s here, in 2 MiB pages 20 ms; a fresh 1 MiB buffer 2.8 ms), and a
// job that keeps a result per step for a lost rank until it is evicted makes a fresh one
// every step. So blocks of 64 KiB or more get a mapping of their own, populated in one call
// (MADV_POPULATE_WRITE); from 2 MiB on it is 2 MiB-aligned and its whole 2 MiB blocks are
// advised as huge pages (MADV_HUGEPAGE), the tail beyond the last one stays in 4 KiB pages (a
// mapping rounded up to a huge page would zero up to twice what is used). Smaller blocks come
// from the heap, 64-byte aligned. Where the kernel refuses the advice the memory works the
// same, faulted in page by page. A failed allocation throws AllocationFailed
// (net/base/out_of_memory.h), a std::bad_alloc naming the size and the current AllocationScope.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace qring::net {

void* alloc_large(size_t bytes);
void free_large(void* p, size_t bytes) noexcept;
// For memory that is already allocated but not yet written (a reserved std::vector): the
// whole pages inside [p, p + bytes) are faulted in now, in one call, as huge pages where a
// 2 MiB-aligned block fits. Advice only: where the kernel refuses it nothing changes.
void populate(void* p, size_t bytes) noexcept;

// An allocator over alloc_large. With DefaultInit, resize() leaves new elements unset (for
// buffers whose every element is written next); otherwise they are value-initialized.
template <class T, bool DefaultInit = false>
struct LargeAllocator {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = LargeAllocator<U, DefaultInit>;
  };
  LargeAllocator() = default;
  template <class U>
  LargeAllocator(const LargeAllocator<U, DefaultInit>&) noexcept {}
  T* allocate(size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_alloc();
    return static_cast<T*>(alloc_large(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) noexcept { free_large(p, n * sizeof(T)); }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    if constexpr (DefaultInit && sizeof...(A) == 0)
      ::new (static_cast<void*>(p)) U;
    else
      ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
  template <class U>
  bool operator==(const LargeAllocator<U, DefaultInit>&) const noexcept {
    return true;
  }
};

template <class T>
using LargeVector = std::vector<T, LargeAllocator<T>>;

}  // namespace qring::net
