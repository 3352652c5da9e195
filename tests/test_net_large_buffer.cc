// net/large_buffer.h: memory for large buffers (huge-page advised above 2 MiB).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "net/large_buffer.h"

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

}  // namespace
}  // namespace qring::net
