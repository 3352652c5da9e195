// net/base/large_buffer.h: memory for large buffers (huge-page advised above 2 MiB).
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>

#include "net/base/large_buffer.h"

namespace qring::net {
namespace {

TEST(LargeBuffer, SmallBlocksAre64ByteAlignedAndLargeOnes2MiB) {
  for (size_t bytes : {size_t{1}, size_t{100}, size_t{4096}, (size_t{2} << 20) - 1}) {
    void* p = alloc_large(bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u) << bytes;
    std::memset(p, 0xab, bytes);
    free_large(p, bytes);
  }
  for (size_t bytes : {size_t{2} << 20, (size_t{2} << 20) + 1, size_t{5} << 20}) {
    auto* p = static_cast<unsigned char*>(alloc_large(bytes));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % (size_t{2} << 20), 0u) << bytes;
    std::memset(p, 0xcd, bytes);  // every byte is ours to write
    EXPECT_EQ(p[0], 0xcd);
    EXPECT_EQ(p[bytes - 1], 0xcd);
    free_large(p, bytes);
  }
  free_large(nullptr, 0);
}

TEST(LargeBuffer, VectorsValueInitializeUnlessAskedNotTo) {
  LargeVector<char> a(3 << 20);
  for (size_t i = 0; i < a.size(); i += 4096) ASSERT_EQ(a[i], 0) << i;
  a.assign(a.size(), 'x');
  std::vector<float, LargeAllocator<float, true>> b;
  b.resize(1 << 20);  // left unset: the caller writes every element
  for (float& x : b) x = 1.5f;
  EXPECT_EQ(b.back(), 1.5f);
  LargeVector<char> c(a.begin(), a.end());
  EXPECT_EQ(c, a);
}

// How many of the pages of [p, p + bytes) are resident (mincore).
size_t resident_pages(void* p, size_t bytes) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  auto* first = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) / page * page);
  const size_t len = reinterpret_cast<uintptr_t>(p) + bytes - reinterpret_cast<uintptr_t>(first);
  std::vector<unsigned char> in((len + page - 1) / page);
  if (mincore(first, len, in.data()) != 0) return 0;
  size_t n = 0;
  for (unsigned char c : in) n += c & 1;
  return n;
}

// A block a little over 2 MiB (the MLP's 2.1 MB gradient, kept once per step for a lagging
// rank) maps and faults in its own pages only, not a second whole huge page: beyond its last
// 4 KiB page nothing is mapped.
TEST(LargeBuffer, ABlockJustOverAHugePageMapsOnlyItsOwnPages) {
  constexpr size_t kBytes = (size_t{2} << 20) + (size_t{100} << 10) + 100;
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t used = (kBytes + page - 1) / page * page;
  auto* p = static_cast<unsigned char*>(alloc_large(kBytes));
  std::memset(p, 0x11, kBytes);
  std::vector<unsigned char> in(1);
  EXPECT_EQ(mincore(p + used - page, page, in.data()), 0) << "its last page is mapped";
  EXPECT_NE(mincore(p + used, page, in.data()), 0)
      << "the page after its last one is mapped: the block was rounded up to a huge page";
  EXPECT_EQ(errno, ENOMEM);
  free_large(p, kBytes);
}

// populate() faults in the pages of memory that is allocated but not yet written, and keeps
// what is written already.
TEST(LargeBuffer, PopulateFaultsInReservedMemoryAndKeepsItsContent) {
  constexpr size_t kBytes = size_t{6} << 20;
  void* m = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  if (madvise(m, 4096, 23 /* MADV_POPULATE_WRITE */) != 0) {
    munmap(m, kBytes);
    GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE (Linux 5.14)";
  }
  munmap(m, kBytes);
  // Fresh memory (a mapping of its own, as a large reserved vector gets from malloc).
  m = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  auto* p = static_cast<unsigned char*>(m);
  std::memset(p, 0x5a, 100);  // the first page is written, the rest untouched
  // From an unaligned start, over all but the last few bytes.
  populate(p + 10, kBytes - 20);
  EXPECT_GE(resident_pages(p, kBytes), kBytes / 4096 - 1);
  for (size_t i = 0; i < 100; ++i) ASSERT_EQ(p[i], 0x5a) << i;
  EXPECT_EQ(p[kBytes / 2], 0);
  populate(p, 0);  // nothing to do
  populate(p + 1, 1);
  munmap(m, kBytes);
}

}  // namespace
}  // namespace qring::net
