#include "train/dataset.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "net/base/error.h"
#include "net/base/fnv1a.h"
#include "train/config.h"
#include "train/idx.h"
#include "train/rng.h"

namespace qring::train {

namespace {

std::string pick(const std::string& dir, const std::string& base) {
  const std::string gz = dir + "/" + base + ".gz";
  if (std::filesystem::exists(gz)) return gz;
  const std::string plain = dir + "/" + base;
  if (std::filesystem::exists(plain)) return plain;
  throw DataError(fmt::format("{}: dataset file not found (also tried without .gz)", gz));
}

// The pixels of an images file as floats, pixel / 255, converted as they are inflated (the
// bytes are never held whole).
void read_images(IdxReader& in, DataVector<float>& out) {
  out.resize(in.first_block());
  std::vector<uint8_t> piece(size_t{1} << 20);
  size_t at = 0;
  while (at < in.total()) {
    if (at == out.size()) out.resize(std::min(in.total(), 2 * at));
    const size_t n = in.read(piece.data(), std::min(piece.size(), out.size() - at));
    float* dst = out.data() + at;
    for (size_t i = 0; i < n; ++i) dst[i] = piece[i] / 255.0f;
    at += n;
  }
  in.finish();
}

// One split's files, their headers read and checked against each other.
struct SplitFiles {
  IdxReader images, labels;
  SplitFiles(const std::string& dir, const std::string& prefix)
      : images(pick(dir, prefix + "-images-idx3-ubyte")),
        labels(pick(dir, prefix + "-labels-idx1-ubyte")) {
    check_idx_image_dims(images.path(), images.dims());
    if (labels.dims().size() != 1)
      throw DataError(fmt::format("{}: a labels file needs 1 dimension, has {}", labels.path(),
                                  labels.dims().size()));
    if (labels.dims()[0] != images.dims()[0])
      throw DataError(fmt::format("{}: {} labels, but {} has {} images", labels.path(),
                                  labels.dims()[0], images.path(), images.dims()[0]));
    if (count() == 0) throw DataError(fmt::format("{}: no images", images.path()));
  }
  size_t count() const { return images.dims()[0]; }
  // What loading it holds at once: the images as floats, the labels as bytes and as int32.
  uint64_t bytes() const { return uint64_t(images.total()) * 4 + uint64_t(count()) * 5; }
};

Dataset load_split(SplitFiles& f) {
  Dataset d;
  d.dim = 784;
  read_images(f.images, d.images);
  std::vector<uint8_t> labels(f.count());
  f.labels.read(labels.data(), labels.size());
  f.labels.finish();
  for (size_t i = 0; i < labels.size(); ++i)
    if (labels[i] >= 10)
      throw DataError(fmt::format("{}: label {} at index {} is out of range 0..9",
                                  f.labels.path(), labels[i], i));
  d.labels.assign(labels.begin(), labels.end());
  return d;
}

uint64_t split_digest(uint64_t h, const SplitFiles& f) {
  for (const IdxReader* r : {&f.images, &f.labels}) {
    for (uint32_t d : r->dims()) h = fnv1a64(&d, sizeof(d), h);
    const uint32_t crc = r->crc();
    h = fnv1a64(&crc, sizeof(crc), h);
  }
  return h;
}

uint64_t mem_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return UINT64_MAX;
}

std::string gib(uint64_t bytes) {
  return fmt::format("{:.2f} GiB", double(bytes) / double(uint64_t{1} << 30));
}

void normalize(Dataset& d, double mean, double std) {
  const float m = static_cast<float>(mean);
  const float inv = static_cast<float>(1.0 / std);
  for (float& x : d.images) x = (x - m) * inv;
}

}  // namespace

MemoryBudget data_budget(const DataSection& cfg, int local_ranks) {
  MemoryBudget b;
  const uint64_t avail = mem_available_bytes();
  if (avail != UINT64_MAX) {
    const int ranks = std::max(1, local_ranks);
    b.bytes = avail / uint64_t(ranks);
    b.source = ranks > 1 ? fmt::format("the available memory of this host ({}) over its {} "
                                       "ranks",
                                       gib(avail), ranks)
                         : fmt::format("the available memory ({})", gib(avail));
  }
  if (cfg.max_bytes > 0 && uint64_t(cfg.max_bytes) < b.bytes) {
    b.bytes = uint64_t(cfg.max_bytes);
    b.source = fmt::format("data.max_bytes = {}", cfg.max_bytes);
  }
  return b;
}

DatasetPair load_fashion_mnist(const std::string& dir, const MemoryBudget& budget) {
  // Every header before any data: a count that disagrees, or more than the budget, costs
  // nothing to find.
  SplitFiles train_files(dir, "train"), test_files(dir, "t10k");
  const uint64_t need = train_files.bytes() + test_files.bytes();
  if (need > budget.bytes)
    throw DataError(fmt::format(
        "{}: {} training and {} test images of 28x28 need {} bytes ({}) in memory, more than "
        "the limit of {} bytes: {} (set data.max_bytes to allow more)",
        train_files.images.path(), train_files.count(), test_files.count(), need, gib(need),
        budget.bytes, budget.source));
  DatasetPair p;
  p.train = load_split(train_files);
  p.test = load_split(test_files);
  p.digest = split_digest(split_digest(kFnv1aOffset, train_files), test_files);
  double sum = 0, sq = 0;
  for (float x : p.train.images) {
    sum += x;
    sq += static_cast<double>(x) * x;
  }
  const double n = static_cast<double>(p.train.images.size());
  p.mean = sum / n;
  p.std = std::sqrt(std::max(sq / n - p.mean * p.mean, 1e-12));
  normalize(p.train, p.mean, p.std);
  normalize(p.test, p.mean, p.std);
  return p;
}

DatasetPair make_synthetic(int64_t n_train, int64_t n_test, uint64_t seed) {
  if (n_train < 1 || n_test < 1)
    throw UsageError(fmt::format("make_synthetic: sizes {} and {} must be >= 1", n_train, n_test));
  constexpr int kClasses = 10, kSide = 28, kCoarse = 7;
  Rng rng(derive_seed(seed, 0x5157));
  // Class prototypes: coarse 7x7 Gaussian noise, nearest-neighbour upsampled.
  std::vector<float> protos(kClasses * 784);
  for (int c = 0; c < kClasses; ++c) {
    float coarse[kCoarse * kCoarse];
    for (float& v : coarse) v = static_cast<float>(rng.normal());
    for (int y = 0; y < kSide; ++y)
      for (int x = 0; x < kSide; ++x)
        protos[c * 784 + y * kSide + x] = coarse[(y / 4) * kCoarse + (x / 4)];
  }
  auto make = [&](int64_t n, uint64_t stream) {
    Rng r(derive_seed(seed, stream));
    Dataset d;
    d.images.resize(static_cast<size_t>(n) * 784);
    d.labels.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) d.labels[i] = static_cast<int32_t>(i % kClasses);
    for (int64_t i = n - 1; i > 0; --i)
      std::swap(d.labels[i], d.labels[static_cast<int64_t>(r.below(i + 1))]);
    for (int64_t i = 0; i < n; ++i) {
      const float contrast = static_cast<float>(0.5 + r.uniform());
      const float* p = protos.data() + d.labels[i] * 784;
      float* out = d.images.data() + i * 784;
      for (int k = 0; k < 784; ++k)
        out[k] = contrast * p[k] + 1.5f * static_cast<float>(r.normal());
    }
    return d;
  };
  DatasetPair pair;
  pair.train = make(n_train, 1);
  pair.test = make(n_test, 2);
  return pair;
}

DatasetPair load_datasets(const DataSection& cfg, uint64_t seed, int local_ranks) {
  const MemoryBudget budget = data_budget(cfg, local_ranks);
  if (cfg.dataset == "fashion-mnist") return load_fashion_mnist(cfg.path, budget);
  if (cfg.dataset == "synthetic") {
    const uint64_t need = (uint64_t(cfg.synthetic_train) + uint64_t(cfg.synthetic_test)) *
                          (784 * sizeof(float) + sizeof(int32_t));
    if (cfg.synthetic_train > (int64_t{1} << 40) || cfg.synthetic_test > (int64_t{1} << 40) ||
        need > budget.bytes)
      throw ConfigError(fmt::format(
          "config keys 'data.synthetic_train' and 'data.synthetic_test': {} + {} samples need "
          "{} bytes in memory, more than the limit of {} bytes: {}",
          cfg.synthetic_train, cfg.synthetic_test, need, budget.bytes, budget.source));
    return make_synthetic(cfg.synthetic_train, cfg.synthetic_test, seed);
  }
  throw ConfigError(fmt::format("config key 'data.dataset': unknown value '{}'", cfg.dataset));
}

Sharder::Sharder(int64_t dataset_size, int rank, int world, int64_t batch, uint64_t seed)
    : n_(dataset_size), rank_(rank), world_(world), batch_(batch), seed_(seed) {
  if (world < 1 || rank < 0 || rank >= world)
    throw UsageError(fmt::format("Sharder: rank {} not in a world of {}", rank, world));
  if (batch < 1) throw UsageError(fmt::format("Sharder: batch {} < 1", batch));
  if (dataset_size > INT32_MAX) throw UsageError("Sharder: dataset larger than 2^31 samples");
  shard_ = n_ / world_;
  batches_per_epoch_ = shard_ / batch_;
  if (batches_per_epoch_ < 1) {
    throw ConfigError(fmt::format(
        "config key 'train.batch_per_rank': {} samples over {} ranks give {} per rank, fewer "
        "than one batch of {}",
        n_, world_, shard_, batch_));
  }
}

void Sharder::seek(DataPosition pos) {
  if (pos.epoch < 0 || pos.index < 0 || pos.index >= batches_per_epoch_) {
    throw UsageError(
        fmt::format("Sharder::seek: position (epoch {}, batch {}) out of range "
                    "({} batches per epoch)",
                    pos.epoch, pos.index, batches_per_epoch_));
  }
  pos_ = pos;
}

std::vector<int32_t> Sharder::epoch_permutation(int64_t epoch) const {
  std::vector<int32_t> perm(static_cast<size_t>(n_));
  for (int64_t i = 0; i < n_; ++i) perm[i] = static_cast<int32_t>(i);
  Rng r(derive_seed(seed_, 0x100000000ULL + static_cast<uint64_t>(epoch)));
  for (int64_t i = n_ - 1; i > 0; --i)
    std::swap(perm[i], perm[static_cast<int64_t>(r.below(static_cast<uint64_t>(i) + 1))]);
  return perm;
}

const std::vector<int32_t>& Sharder::next_batch() {
  if (perm_epoch_ != pos_.epoch) {
    perm_ = epoch_permutation(pos_.epoch);
    perm_epoch_ = pos_.epoch;
  }
  const int64_t start = rank_ * shard_ + pos_.index * batch_;
  out_.assign(perm_.begin() + start, perm_.begin() + start + batch_);
  if (++pos_.index == batches_per_epoch_) {
    pos_.index = 0;
    ++pos_.epoch;
  }
  return out_;
}

void gather_batch(const Dataset& d, const std::vector<int32_t>& idx, float* x, int32_t* y) {
  const size_t dim = static_cast<size_t>(d.dim);
  for (size_t i = 0; i < idx.size(); ++i) {
    if (idx[i] < 0 || idx[i] >= d.size())
      throw UsageError(fmt::format("gather_batch: index {} out of range", idx[i]));
    std::memcpy(x + i * dim, d.image(idx[i]), dim * sizeof(float));
    y[i] = d.labels[static_cast<size_t>(idx[i])];
  }
}

}  // namespace qring::train
