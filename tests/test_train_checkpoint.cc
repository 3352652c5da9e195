#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "net/base/error.h"
#include "checkpoint_files.h"
#include "temp_dir.h"
#include "train/checkpoint.h"
#include "train/crc32.h"
#include "train/rng.h"

namespace qring::train {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using qring::testing::TempDir;

CheckpointState sample_state() {
  CheckpointState s;
  s.step = 12345;
  s.position = {7, 42};
  s.config_fingerprint = 0xdeadbeefcafef00dULL;
  s.world = 4;
  s.rank = 2;
  Rng r(3);
  s.params.resize(1001);
  for (auto& p : s.params) p = static_cast<float>(r.normal());
  s.params[5] = -0.0f;   // bit patterns, not just values, must survive
  s.params[6] = 1e-40f;  // denormal
  s.velocity.resize(1001);
  for (auto& v : s.velocity) v = static_cast<float>(r.uniform());
  s.carry = {1.5f, -2.5f};
  s.rng_state = r.state_bytes();
  s.meta = R"({"note":"test"})";
  return s;
}

std::vector<uint8_t> read_raw(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_raw(const std::string& p, const std::vector<uint8_t>& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

void expect_load_error(const std::string& path, const std::string& what) {
  try {
    load_checkpoint(path);
    ADD_FAILURE() << "no DataError (" << what << ")";
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(), HasSubstr(path));
    EXPECT_THAT(e.what(), HasSubstr(what));
  }
}

TEST(Checkpoint, RoundTripIsBitIdentical) {
  TempDir dir("qring-ckpt");
  const CheckpointState s = sample_state();
  const std::string p = checkpoint_path(dir.path(), s.step);
  EXPECT_THAT(p, HasSubstr("ckpt-000000012345.qck"));
  save_checkpoint(p, s);
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  CheckpointState back = load_checkpoint(p);
  EXPECT_EQ(back.step, s.step);
  EXPECT_EQ(back.position, s.position);
  EXPECT_EQ(back.config_fingerprint, s.config_fingerprint);
  EXPECT_EQ(back.world, 4u);
  EXPECT_EQ(back.rank, 2u);
  ASSERT_EQ(back.params.size(), s.params.size());
  EXPECT_EQ(std::memcmp(back.params.data(), s.params.data(), s.params.size() * 4), 0);
  EXPECT_EQ(std::memcmp(back.velocity.data(), s.velocity.data(), s.velocity.size() * 4), 0);
  EXPECT_EQ(back.carry, s.carry);
  EXPECT_EQ(back.rng_state, s.rng_state);
  EXPECT_EQ(back.meta, s.meta);
  Rng restored;
  ASSERT_TRUE(restored.set_state_bytes(back.rng_state));
  Rng original(3);
  for (size_t i = 0; i < 2 * 1001 + 1001; ++i) original.next_u64();  // sample_state's draws
  EXPECT_EQ(restored.next_u64(), original.next_u64());
  // Overwriting replaces the file atomically with the new content.
  CheckpointState s2 = s;
  s2.step = 1;
  s2.params.clear();
  save_checkpoint(p, s2);
  EXPECT_EQ(load_checkpoint(p), s2);
}

// A rejoining rank restores the state it received where it lies: the view has the same
// content as decode_checkpoint's copy, its arrays point into the bytes, and the checks are
// the same (a corrupt byte is a DataError). Bytes that do not start at a 4-byte boundary are
// refused (the floats are read in place).
TEST(Checkpoint, DecodedViewPointsIntoTheBytesWithTheSameContent) {
  const CheckpointState s = sample_state();
  std::vector<uint8_t> bytes = encode_checkpoint(s);
  const CheckpointView v = decode_checkpoint_view(bytes, "the state");
  const auto* lo = bytes.data();
  const auto* hi = bytes.data() + bytes.size();
  auto inside = [&](const void* p) {
    return static_cast<const uint8_t*>(p) >= lo && static_cast<const uint8_t*>(p) < hi;
  };
  ASSERT_FALSE(v.params.empty());
  EXPECT_TRUE(inside(v.params.data()));
  EXPECT_TRUE(inside(v.velocity.data()));
  EXPECT_EQ(encode_checkpoint(v), bytes);
  EXPECT_EQ(decode_checkpoint(bytes, "the state"), s);

  std::vector<uint8_t> bad = bytes;
  bad[bad.size() / 2] ^= 1;
  try {
    decode_checkpoint_view(bad, "the state from rank 3");
    FAIL() << "a corrupt state decoded";
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(), HasSubstr("the state from rank 3: corrupt checkpoint: CRC-32"));
  }
  std::vector<uint8_t> shifted(bytes.size() + 1);
  std::memcpy(shifted.data() + 1, bytes.data(), bytes.size());
  EXPECT_THROW(decode_checkpoint_view(std::span<const uint8_t>(shifted).subspan(1), "shifted"),
               UsageError);
}

// The state sent to a rejoining rank is encoded from spans into a reused buffer: the same
// bytes as a checkpoint file's, of the size computed beforehand, whatever the buffer held.
TEST(Checkpoint, EncodingFromAViewIntoAReusedBufferGivesTheSameBytes) {
  const CheckpointState s = sample_state();
  const std::vector<uint8_t> ref = encode_checkpoint(s);
  EXPECT_EQ(encoded_checkpoint_size(view_of(s)), ref.size());
  EXPECT_EQ(encode_checkpoint(view_of(s)), ref);
  std::vector<char> buf(3 * ref.size(), 'x');  // larger and full of something else
  encode_checkpoint_into(view_of(s), buf);
  ASSERT_EQ(buf.size(), ref.size());
  EXPECT_EQ(std::memcmp(buf.data(), ref.data(), ref.size()), 0);
  const CheckpointState back =
      decode_checkpoint(std::vector<uint8_t>(buf.begin(), buf.end()), "the reused buffer");
  EXPECT_EQ(back, s);
  // Smaller content into the same buffer: no trace of the earlier one.
  CheckpointState small = s;
  small.params.resize(3);
  small.meta.clear();
  encode_checkpoint_into(view_of(small), buf);
  EXPECT_EQ(std::vector<uint8_t>(buf.begin(), buf.end()), encode_checkpoint(small));
}

TEST(Checkpoint, EmptyStateRoundTrips) {
  TempDir dir("qring-ckpt");
  const std::string p = dir.path() + "/empty.qck";
  save_checkpoint(p, CheckpointState{});
  EXPECT_EQ(load_checkpoint(p), CheckpointState{});
}

TEST(Checkpoint, DetectsCorruption) {
  TempDir dir("qring-ckpt");
  const std::string p = dir.path() + "/c.qck";
  save_checkpoint(p, sample_state());
  const auto good = read_raw(p);

  auto flipped = good;
  flipped[good.size() / 2] ^= 0x01;
  write_raw(p, flipped);
  expect_load_error(p, "CRC-32");

  auto truncated = good;
  truncated.resize(good.size() - 10);
  write_raw(p, truncated);
  expect_load_error(p, "truncated");

  write_raw(p, std::vector<uint8_t>(good.begin(), good.begin() + 10));
  expect_load_error(p, "truncated");

  auto magic = good;
  magic[0] = 'X';
  write_raw(p, magic);
  expect_load_error(p, "bad magic");

  auto version = good;
  version[8] = 9;
  write_raw(p, version);
  expect_load_error(p, "unsupported checkpoint version 9");

  auto longer = good;
  longer.push_back(0);
  write_raw(p, longer);
  expect_load_error(p, "corrupt");

  expect_load_error(dir.path() + "/none.qck", "cannot open");
}

// The checksum of checkpoints and of the rejoin state: zlib's CRC-32, also where the bulk is
// folded by carry-less multiplication (lengths of 64 bytes and more), at any alignment and
// continued from any value.
TEST(Crc32, GivesZlibsValueForEveryLengthAlignmentAndStart) {
  EXPECT_EQ(crc32_ieee(0, "123456789", 9), 0xCBF43926u);  // the check value of CRC-32
  Rng rng(7);
  std::vector<uint8_t> bytes(1 << 20);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng.next_u64());
  for (size_t n = 0; n <= 300; ++n)
    for (size_t off = 0; off < 16; off += 3) {
      const auto start = static_cast<uint32_t>(rng.next_u64());
      ASSERT_EQ(crc32_ieee(start, bytes.data() + off, n),
                crc32_ieee_zlib(start, bytes.data() + off, n))
          << n << " bytes at offset " << off;
    }
  EXPECT_EQ(crc32_ieee(0, bytes.data() + 5, bytes.size() - 5),
            crc32_ieee_zlib(0, bytes.data() + 5, bytes.size() - 5));
  // In pieces, as a stream: the same as at once.
  const uint32_t half = crc32_ieee(0, bytes.data(), 1000);
  EXPECT_EQ(crc32_ieee(half, bytes.data() + 1000, 5000), crc32_ieee_zlib(0, bytes.data(), 6000));
}

TEST(Checkpoint, WriteFailureIsAnError) {
  EXPECT_THROW(save_checkpoint("/nonexistent-dir/x.qck", CheckpointState{}), Error);
}

TEST(Checkpoint, LatestPicksHighestStep) {
  TempDir dir("qring-ckpt");
  EXPECT_FALSE(latest_checkpoint(dir.path()).has_value());
  EXPECT_FALSE(latest_checkpoint(dir.path() + "/missing").has_value());
  CheckpointState s;
  for (uint64_t step : {100u, 2000u, 30u}) {
    s.step = step;
    save_checkpoint(checkpoint_path(dir.path(), step), s);
  }
  std::ofstream(checkpoint_path(dir.path(), 99999) + ".tmp") << "partial";
  std::ofstream(dir.path() + "/notes.txt") << "x";
  auto latest = latest_checkpoint(dir.path());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(*latest, checkpoint_path(dir.path(), 2000));
  EXPECT_EQ(load_checkpoint(*latest).step, 2000u);
}

// Issue 15, item 13: stray names whose step does not fit (the old code aborted with
// "stoull") or that checkpoint_path() would not write are ignored, not fatal.
TEST(Checkpoint, StrayNamesAreIgnored) {
  TempDir dir("qring-ckpt");
  CheckpointState s;
  for (uint64_t step : {7u, 40u}) {
    s.step = step;
    save_checkpoint(checkpoint_path(dir.path(), step), s);
  }
  std::ofstream(dir.path() + "/ckpt-99999999999999999999.qck") << "stray";  // > UINT64_MAX
  std::ofstream(dir.path() + "/ckpt-18446744073709551615.qck") << "stray";  // > INT64_MAX
  std::ofstream(dir.path() + "/ckpt-0000000000050.qck") << "stray";         // not as written
  EXPECT_EQ(checkpoint_steps(dir.path()), (std::vector<uint64_t>{40, 7}));
  EXPECT_EQ(latest_checkpoint(dir.path()), checkpoint_path(dir.path(), 40));
  // The largest step that fits is a checkpoint name like any other.
  const uint64_t max = uint64_t(std::numeric_limits<int64_t>::max());
  std::ofstream(checkpoint_path(dir.path(), max)) << "x";
  EXPECT_EQ(checkpoint_steps(dir.path()), (std::vector<uint64_t>{max, 40, 7}));
  EXPECT_EQ(checkpoint_steps(dir.path() + "/missing"), std::vector<uint64_t>{});
}

// Issue 44: size and header before the body. A sparse file of 1 GiB whose header claims it
// all is refused at its size when a limit is given, and at its header (bad magic) when not,
// without being read (it was read whole: 10 s, 1.1 GB).
TEST(Checkpoint, SizeAndHeaderAreCheckedBeforeTheBody) {
  TempDir dir("qring-ckpt");
  const std::string p = dir.path() + "/big.qck";
  qring::testing::sparse_checkpoint(p, uint64_t{1} << 30, /*with_header=*/true);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    load_checkpoint(p, max_checkpoint_bytes(1000));
    ADD_FAILURE() << "loaded";
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("1073741824 bytes, more than the limit of"));
  }
  qring::testing::sparse_checkpoint(p, uint64_t{1} << 30, /*with_header=*/false);
  expect_load_error(p, "bad magic");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  expect_load_error(dir.path(), "not a regular file");
  EXPECT_GE(max_checkpoint_bytes(1000), encoded_checkpoint_size(view_of(sample_state())));
}

}  // namespace
}  // namespace qring::train
