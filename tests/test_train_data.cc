#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "net/base/error.h"
#include "train/config.h"
#include "temp_dir.h"
#include "train/dataset.h"
#include "train/idx.h"

namespace qring::train {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using qring::testing::TempDir;

std::vector<uint8_t> bytes(size_t n, int mul) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((i * mul + 7) % 256);
  return v;
}

std::vector<uint8_t> read_raw(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_raw(const std::string& p, const std::vector<uint8_t>& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Expects DataError whose message names the file and contains `what`.
template <class F>
void expect_data_error(F&& f, const std::string& file, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << "no DataError for " << file << " (" << what << ")";
  } catch (const DataError& e) {
    EXPECT_THAT(e.what(), HasSubstr(file));
    EXPECT_THAT(e.what(), HasSubstr(what));
  }
}

TEST(Idx, RoundTripPlainAndGzip) {
  TempDir dir("qring-data");
  const auto data = bytes(5 * 28 * 28, 13);
  for (bool gz : {false, true}) {
    const std::string p = dir.file(gz ? "a.gz" : "a");
    write_idx(p, {5, 28, 28}, data, gz);
    const auto raw = read_raw(p);
    ASSERT_GE(raw.size(), 2u);
    EXPECT_EQ(raw[0] == 0x1f && raw[1] == 0x8b, gz);  // gzip magic only when compressed
    IdxArray a = read_idx_images(p);
    EXPECT_EQ(a.dims, (std::vector<uint32_t>{5, 28, 28}));
    EXPECT_EQ(a.data, data);
  }
  const std::vector<uint8_t> labels = {0, 9, 3, 3, 1};
  write_idx(dir.file("l.gz"), {5}, labels, true);
  EXPECT_EQ(read_idx_labels(dir.file("l.gz")).data, labels);
}

TEST(Idx, HeaderErrors) {
  TempDir dir("qring-data");
  const std::string p = dir.file("x");
  write_raw(p, {0x01, 0x00, 0x08, 0x01, 0, 0, 0, 1, 5});
  expect_data_error([&] { read_idx(p); }, p, "bad IDX magic");
  write_raw(p, {0x00, 0x00, 0x0D, 0x01, 0, 0, 0, 1, 0, 0, 0, 0});
  expect_data_error([&] { read_idx(p); }, p, "unsupported IDX data type 0x0d");
  write_raw(p, {0x00, 0x00, 0x08, 0x07});
  expect_data_error([&] { read_idx(p); }, p, "dimension count 7");
  write_raw(p, {0x00, 0x00, 0x08, 0x03, 0, 0, 0, 1, 0, 0});
  expect_data_error([&] { read_idx(p); }, p, "truncated IDX header");
  write_raw(p, {0x00, 0x00});
  expect_data_error([&] { read_idx(p); }, p, "truncated IDX header");
  write_raw(p, {0x00, 0x00, 0x08, 0x02, 0, 0, 0, 2, 0, 0, 0, 0});
  expect_data_error([&] { read_idx(p); }, p, "dimension 1 is zero");
  expect_data_error([&] { read_idx(dir.file("missing.gz")); }, dir.file("missing.gz"),
                    "cannot open");
}

TEST(Idx, TruncatedAndTrailingData) {
  TempDir dir("qring-data");
  const std::string p = dir.file("img");
  write_idx(p, {4, 28, 28}, bytes(4 * 784, 3), false);
  auto raw = read_raw(p);
  raw.resize(raw.size() - 100);
  write_raw(p, raw);
  expect_data_error([&] { read_idx(p); }, p, "truncated IDX data: dimensions need 3136 bytes");
  raw.resize(raw.size() + 300, 0);
  write_raw(p, raw);
  expect_data_error([&] { read_idx(p); }, p, "200 trailing bytes");
}

TEST(Idx, TruncatedAndCorruptGzip) {
  TempDir dir("qring-data");
  const std::string p = dir.file("img.gz");
  write_idx(p, {50, 28, 28}, bytes(50 * 784, 7), true);
  const auto good = read_raw(p);
  auto cut = good;
  cut.resize(good.size() / 2);
  write_raw(p, cut);
  expect_data_error([&] { read_idx(p); }, p, "truncated gzip data: unexpected end of file");
  auto bad = good;
  bad[good.size() - 6] ^= 0xff;  // inside the CRC-32 trailer
  write_raw(p, bad);
  expect_data_error([&] { read_idx(p); }, p, "gzip data: incorrect data check");
}

// A gzip file whose stream starts with `head` and then inflates to `zeros` more zero bytes,
// with its end cut off: only a reader that inflates the whole stream reaches the cut.
void write_truncated_bomb(const std::string& p, const std::vector<uint8_t>& head, size_t zeros) {
  gzFile f = gzopen(p.c_str(), "wb9");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, head.data(), static_cast<unsigned>(head.size())), int(head.size()));
  const std::vector<uint8_t> chunk(1 << 20, 0);
  for (size_t done = 0; done < zeros; done += chunk.size())
    ASSERT_EQ(gzwrite(f, chunk.data(), static_cast<unsigned>(chunk.size())), int(chunk.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
  auto raw = read_raw(p);
  ASSERT_GT(raw.size(), 4096u);  // the cut below lies far after the IDX header and data
  raw.resize(raw.size() - 64);
  write_raw(p, raw);
}

// Issue 15, item 11: the header is checked before the stream is inflated, and reading stops
// at the size it implies. Each file inflates to 64 MiB and is truncated at the end; the old
// reader inflated all of it and reported the truncation instead.
TEST(Idx, GzipBombIsRefusedAfterItsHeader) {
  TempDir dir("qring-data");
  const std::string p = dir.file("bomb.gz");
  write_truncated_bomb(p, {0x1f, 0x8b, 0x08, 0x03}, size_t{64} << 20);
  expect_data_error([&] { read_idx(p); }, p, "bad IDX magic number 0x1f8b0803");

  std::vector<uint8_t> head = {0x00, 0x00, 0x08, 0x03, 0, 0, 0, 2, 0, 0, 0, 28, 0, 0, 0, 28};
  const auto data = bytes(2 * 784, 5);
  head.insert(head.end(), data.begin(), data.end());
  write_truncated_bomb(p, head, size_t{64} << 20);
  expect_data_error([&] { read_idx_images(p); }, p,
                    "more than 65536 trailing bytes after the IDX data (1568 expected)");

  // A header that claims more than the file holds: an error once the data ends, after
  // reading only what is there.
  write_raw(p, {0x00, 0x00, 0x08, 0x01, 0xff, 0xff, 0xff, 0xff, 1, 2, 3});
  expect_data_error([&] { read_idx(p); }, p,
                    "truncated IDX data: dimensions need 4294967295 bytes, file has 3");
}

TEST(Idx, ImageAndLabelValidation) {
  TempDir dir("qring-data");
  const std::string img = dir.file("img");
  write_idx(img, {3, 27, 28}, bytes(3 * 27 * 28, 1), false);
  expect_data_error([&] { read_idx_images(img); }, img, "27x28, expected 28x28");
  write_idx(img, {3, 784}, bytes(3 * 784, 1), false);
  expect_data_error([&] { read_idx_images(img); }, img, "needs 3 dimensions");
  const std::string lab = dir.file("lab");
  write_idx(lab, {4}, {1, 2, 11, 3}, false);
  expect_data_error([&] { read_idx_labels(lab); }, lab, "label 11 at index 2");
  write_idx(lab, {2, 2}, {1, 2, 3, 4}, false);
  expect_data_error([&] { read_idx_labels(lab); }, lab, "needs 1 dimension");
}

void write_split(const TempDir& dir, const std::string& prefix, uint32_t n_img, uint32_t n_lab) {
  write_idx(dir.file(prefix + "-images-idx3-ubyte.gz"), {n_img, 28, 28}, bytes(n_img * 784, 5),
            true);
  std::vector<uint8_t> labels(n_lab);
  for (uint32_t i = 0; i < n_lab; ++i) labels[i] = static_cast<uint8_t>(i % 10);
  write_idx(dir.file(prefix + "-labels-idx1-ubyte.gz"), {n_lab}, labels, true);
}

TEST(Dataset, LoadsDirectoryAndNormalizes) {
  TempDir dir("qring-data");
  write_split(dir, "train", 20, 20);
  write_split(dir, "t10k", 10, 10);
  DatasetPair d = load_fashion_mnist(dir.path());
  EXPECT_EQ(d.train.size(), 20);
  EXPECT_EQ(d.test.size(), 10);
  EXPECT_EQ(d.train.labels[13], 3);
  double sum = 0, sq = 0;
  for (float x : d.train.images) sum += x, sq += double{x} * x;
  const double n = static_cast<double>(d.train.images.size());
  EXPECT_NEAR(sum / n, 0.0, 1e-4);
  EXPECT_NEAR(sq / n, 1.0, 1e-3);
  EXPECT_GT(d.std, 0.0);
  // Pixel 0 of image 0 is byte 7: check the documented formula.
  EXPECT_NEAR(d.train.images[0], (7 / 255.0 - d.mean) / d.std, 1e-5);
}

TEST(Dataset, CountMismatchAndMissingFile) {
  TempDir dir("qring-data");
  write_split(dir, "train", 20, 19);
  write_split(dir, "t10k", 10, 10);
  expect_data_error([&] { load_fashion_mnist(dir.path()); }, "train-labels-idx1-ubyte.gz",
                    "19 labels, but");
  TempDir empty;
  expect_data_error([&] { load_fashion_mnist(empty.path()); }, empty.path(), "not found");
}

TEST(Dataset, RealFashionMnistTestSet) {
  const std::string dir = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(dir + "/t10k-images-idx3-ubyte.gz")) GTEST_SKIP() << dir << " not installed";
  IdxArray images = read_idx_images(dir + "/t10k-images-idx3-ubyte.gz");
  IdxArray labels = read_idx_labels(dir + "/t10k-labels-idx1-ubyte.gz");
  EXPECT_EQ(images.dims, (std::vector<uint32_t>{10000, 28, 28}));
  ASSERT_EQ(labels.dims, (std::vector<uint32_t>{10000}));
  std::vector<int> counts(10, 0);
  for (uint8_t l : labels.data) ++counts.at(l);
  for (int c : counts) EXPECT_EQ(c, 1000);  // the test set is balanced
}

TEST(Dataset, SyntheticIsDeterministicAndBalanced) {
  DatasetPair a = make_synthetic(1000, 200, 5);
  DatasetPair b = make_synthetic(1000, 200, 5);
  DatasetPair c = make_synthetic(1000, 200, 6);
  EXPECT_EQ(a.train.images, b.train.images);
  EXPECT_EQ(a.test.labels, b.test.labels);
  EXPECT_NE(a.train.images, c.train.images);
  EXPECT_NE(a.train.images, a.test.images);
  std::vector<int> counts(10, 0);
  for (int32_t l : a.train.labels) ++counts.at(l);
  for (int n : counts) EXPECT_EQ(n, 100);
  // Learnable: the nearest class mean (from train) classifies most test samples.
  std::vector<double> mean(10 * 784, 0.0);
  for (int64_t i = 0; i < a.train.size(); ++i)
    for (int k = 0; k < 784; ++k) mean[a.train.labels[i] * 784 + k] += a.train.image(i)[k] / 100.0;
  int right = 0;
  for (int64_t i = 0; i < a.test.size(); ++i) {
    int best = 0;
    double best_d = 1e300;
    for (int cl = 0; cl < 10; ++cl) {
      double d = 0;
      for (int k = 0; k < 784; ++k) d += std::pow(a.test.image(i)[k] - mean[cl * 784 + k], 2);
      if (d < best_d) best_d = d, best = cl;
    }
    right += best == a.test.labels[i];
  }
  EXPECT_GT(right, 180);
}

TEST(Sharder, RanksPartitionEachEpoch) {
  const int64_t n = 1003;
  const int world = 4;
  const int64_t batch = 10;
  std::vector<Sharder> shards;
  for (int r = 0; r < world; ++r) shards.emplace_back(n, r, world, batch, 99);
  EXPECT_EQ(shards[0].batches_per_epoch(), 25);  // floor(floor(1003/4)/10)
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::set<int32_t> seen;
    for (int r = 0; r < world; ++r) {
      for (int64_t b = 0; b < 25; ++b) {
        EXPECT_EQ(shards[r].position(), (DataPosition{epoch, b}));
        for (int32_t i : shards[r].next_batch()) {
          EXPECT_TRUE(i >= 0 && i < n);
          EXPECT_TRUE(seen.insert(i).second) << "sample " << i << " twice in epoch " << epoch;
        }
      }
    }
    EXPECT_EQ(seen.size(), 1000u);
  }
  EXPECT_EQ(shards[0].position(), (DataPosition{2, 0}));
}

TEST(Sharder, ShuffleDependsOnSeedAndEpoch) {
  Sharder a(500, 0, 1, 50, 1), b(500, 0, 1, 50, 1), c(500, 0, 1, 50, 2);
  EXPECT_EQ(a.epoch_permutation(3), b.epoch_permutation(3));
  EXPECT_NE(a.epoch_permutation(3), a.epoch_permutation(4));
  EXPECT_NE(a.epoch_permutation(3), c.epoch_permutation(3));
  auto p = a.epoch_permutation(0);
  std::sort(p.begin(), p.end());
  for (int i = 0; i < 500; ++i) EXPECT_EQ(p[i], i);
}

TEST(Sharder, SeekResumesTheSameStream) {
  Sharder a(777, 1, 3, 16, 11);
  std::vector<std::vector<int32_t>> first;
  for (int i = 0; i < 40; ++i) first.push_back(a.next_batch());  // crosses epoch boundaries
  Sharder b(777, 1, 3, 16, 11);
  for (int i = 0; i < 23; ++i) b.next_batch();
  const DataPosition saved = b.position();
  Sharder c(777, 1, 3, 16, 11);
  c.seek(saved);
  for (int i = 23; i < 40; ++i) EXPECT_EQ(c.next_batch(), first[i]) << "batch " << i;
  EXPECT_THROW(c.seek({0, c.batches_per_epoch()}), UsageError);
}

TEST(Sharder, RejectsImpossibleShapes) {
  EXPECT_THROW(Sharder(10, 0, 4, 3, 1), ConfigError);  // 2 samples per rank < batch 3
  EXPECT_THROW(Sharder(100, 4, 4, 3, 1), UsageError);
  EXPECT_THROW(Sharder(100, 0, 1, 0, 1), UsageError);
}

TEST(Dataset, GatherBatch) {
  DatasetPair d = make_synthetic(50, 10, 3);
  std::vector<float> x(2 * 784);
  std::vector<int32_t> y(2);
  gather_batch(d.train, {7, 2}, x.data(), y.data());
  EXPECT_EQ(y[0], d.train.labels[7]);
  EXPECT_EQ(y[1], d.train.labels[2]);
  EXPECT_TRUE(std::equal(x.begin() + 784, x.end(), d.train.image(2)));
  EXPECT_THROW(gather_batch(d.train, {50}, x.data(), y.data()), UsageError);
}

// Issue 44, N5: every header before any data, and the memory the counts imply against the
// budget; the digest tells the files apart by content, not by compression.
TEST(Dataset, HeadersAreCheckedAgainstEachOtherAndTheBudgetFirst) {
  TempDir dir("qring-data");
  write_split(dir, "train", 20, 20);
  write_split(dir, "t10k", 10, 10);
  MemoryBudget tight;
  tight.bytes = 30 * 3141 - 1;  // one byte short of 20 + 10 images and labels
  tight.source = "the test's budget";
  expect_data_error([&] { load_fashion_mnist(dir.path(), tight); }, "train-images-idx3-ubyte.gz",
                    "20 training and 10 test images of 28x28 need 94230 bytes (0.00 GiB) in "
                    "memory, more than the limit of 94229 bytes: the test's budget");
  tight.bytes += 1;
  const DatasetPair a = load_fashion_mnist(dir.path(), tight);
  EXPECT_NE(a.digest, 0u);
  // The same content uncompressed: the same digest; one pixel else: another.
  TempDir plain("qring-data");
  for (const char* f : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                        "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
    IdxArray x = read_idx(dir.file(std::string(f) + ".gz"));
    write_idx(plain.file(f), x.dims, x.data, false);
  }
  EXPECT_EQ(load_fashion_mnist(plain.path()).digest, a.digest);
  IdxArray img = read_idx(plain.file("t10k-images-idx3-ubyte"));
  img.data[5] ^= 1;
  write_idx(plain.file("t10k-images-idx3-ubyte"), img.dims, img.data, false);
  EXPECT_NE(load_fashion_mnist(plain.path()).digest, a.digest);
  // A test set whose labels disagree is found before the training images are read.
  write_split(dir, "t10k", 10, 9);
  expect_data_error([&] { load_fashion_mnist(dir.path()); }, "t10k-labels-idx1-ubyte.gz",
                    "9 labels, but");
  DataSection cfg;
  cfg.max_bytes = 12345;
  const MemoryBudget b = data_budget(cfg, 4);
  EXPECT_EQ(b.bytes, 12345u);
  EXPECT_EQ(b.source, "data.max_bytes = 12345");
}

}  // namespace
}  // namespace qring::train
